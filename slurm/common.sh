# shellcheck shell=bash
# Shared by the slurm/bapo_*.sh job scripts: echoed commands, the job's log directory, the trainer's
# rendezvous, optional pyxis/enroot containers, engines on nodes of their own, the warning signal
# (checkpoint, then requeue) and cleanup of this job's processes only.
#
# The job scripts set, before sourcing this file:
#   CONFIG                 the preset (a path inside the checkout or the image)
# and read from the environment (all optional unless stated):
#   BAPO_HOME              the checkout or the image's copy of it (default: the submit directory)
#   RUN_DIR                the run's directory: checkpoints, metrics, export (default: runs/<job name>)
#   CONTAINER_IMAGE        run every step in this pyxis/enroot image (srun --container-image)
#   CONTAINER_MOUNTS       srun --container-mounts (default: the checkout and the run directory)
#   NET_IF                 the network interface for NCCL and gloo (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)

set -euo pipefail

BAPO_HOME=${BAPO_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
RUN_DIR=${RUN_DIR:-$BAPO_HOME/runs/${SLURM_JOB_NAME:-bapo}}
LOG_DIR=${LOG_DIR:-$RUN_DIR/logs/job-${SLURM_JOB_ID:-local}}
PYTHON=${PYTHON:-python3}
mkdir -p "$RUN_DIR" "$LOG_DIR"
cd "$BAPO_HOME"

# Print a command (shell-quoted, with a +).
show() {
    printf '+' >&2
    printf ' %q' "$@" >&2
    printf '\n' >&2
}

# Print a command, then run it. (In the background, write `show CMD; CMD &` instead: `run CMD &` would
# make $! a subshell's, and a signal meant for the command would stop the subshell.)
run() {
    show "$@"
    "$@"
}

# has_override KEY [key=value ...]: whether the arguments set KEY (KEY=...), as bapo-train reads them.
has_override() {
    local key=$1 arg
    shift
    for arg in "$@"; do
        if [[ $arg == "$key="* ]]; then
            return 0
        fi
    done
    return 1
}

# Every node of the job, one name a line, in Slurm's order.
job_nodes() {
    scontrol show hostnames "$SLURM_JOB_NODELIST"
}

# srun options every step shares: the container when one is named, the network interface.
SRUN_COMMON=(--kill-on-bad-exit=1 --export=ALL)
if [[ -n ${CONTAINER_IMAGE:-} ]]; then
    SRUN_COMMON+=(
        --container-image="$CONTAINER_IMAGE"
        --container-mounts="${CONTAINER_MOUNTS:-$BAPO_HOME:$BAPO_HOME,$RUN_DIR:$RUN_DIR}"
        --container-workdir="$BAPO_HOME"
    )
fi
if [[ -n ${NET_IF:-} ]]; then
    export NCCL_SOCKET_IFNAME=$NET_IF GLOO_SOCKET_IFNAME=$NET_IF
fi
# A rank that dies takes the job down instead of leaving the others in a collective for ever.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export PYTHONUNBUFFERED=1

# The rendezvous of the trainer's srun step (bapo-train reads Slurm's task variables itself):
# the first trainer node, and a port that differs between jobs sharing a node.
trainer_rendezvous() {
    local first_node=$1
    export MASTER_ADDR=$first_node
    export MASTER_PORT=$((20000 + ${SLURM_JOB_ID:-0} % 20000))
}

# The admin key of engines that listen beyond loopback, shared by the engines and the trainer
# (a 0600 file in the run directory, made once; a requeued job keeps it).
shared_admin_key() {
    local key_file=$RUN_DIR/admin_api_key
    if [[ ! -s $key_file ]]; then
        (umask 077 && "$PYTHON" -c 'import secrets; print(secrets.token_hex(32))' >"$key_file")
    fi
    echo "$key_file"
}

# --- engines on nodes of their own ------------------------------------------------------------

ENGINE_PID=""
ENGINE_SRUN=() # further srun options of the engines' step (the job script: GPUs, CPUs)

# start_engines NODELIST SERVERS_PER_NODE PORT [key=value ...]: one srun step of bapo-serve tasks
# (one an engine) on the rollout nodes; sets ENGINE_URLS (a YAML list for rollout.engines.urls).
start_engines() {
    local nodelist=$1 per_node=$2 port=$3
    shift 3
    local nodes
    mapfile -t nodes < <(scontrol show hostnames "$nodelist")
    local count=$((${#nodes[@]} * per_node))
    local urls=()
    for node in "${nodes[@]}"; do
        for ((i = 0; i < per_node; i++)); do
            urls+=("\"http://$node:$((port + ${#urls[@]}))\"")
        done
    done
    ENGINE_URLS="[$(IFS=,; echo "${urls[*]}")]"
    # Engine k listens on port + k, on its node's GPUs k % per_node (bapo-serve --index = SLURM_PROCID).
    local command=(
        srun "${SRUN_COMMON[@]}" "${ENGINE_SRUN[@]}" --nodelist="$nodelist" --nodes="${#nodes[@]}"
        --ntasks="$count" --ntasks-per-node="$per_node" --output="$LOG_DIR/engines-%t.log"
        "$PYTHON" -m bapo_megatron.serve "$CONFIG" "$@" "rollout.engines.servers=$count" "rollout.engines.port=$port"
        "rollout.engines.host=0.0.0.0"
    )
    show "${command[@]}"
    "${command[@]}" &
    ENGINE_PID=$!
    # the trainer connects only to engines that answer: wait for all (a 32B model loads for minutes)
    run srun "${SRUN_COMMON[@]}" --overlap --nodes=1 --ntasks=1 \
        "$PYTHON" -m bapo_megatron.serve "$CONFIG" "$@" "rollout.engines.urls=$ENGINE_URLS" --wait
}

stop_engines() {
    if [[ -n $ENGINE_PID ]] && kill -0 "$ENGINE_PID" 2>/dev/null; then
        echo "+ stopping the engines (srun pid $ENGINE_PID)" >&2
        kill -TERM "$ENGINE_PID" 2>/dev/null || true # srun passes it to every engine task
        wait "$ENGINE_PID" 2>/dev/null || true
    fi
    ENGINE_PID=""
}

# --- the trainer, the warning signal and requeue -------------------------------------------

TRAINER_PID=""
SIGNALLED=""

# Slurm sends the batch shell USR1 (#SBATCH --signal=B:USR1@300) some minutes before the time
# limit: the trainer's ranks get it (srun passes it on), save at the next step boundary and exit 0
# with status.json's state "stopped"; the job then requeues itself and resumes from `latest`.
on_warning() {
    SIGNALLED=USR1
    echo "+ USR1 (time limit near): the trainer saves at the next step boundary" >&2
    if [[ -n $TRAINER_PID ]]; then
        kill -USR1 "$TRAINER_PID" 2>/dev/null || true
    fi
}
trap on_warning USR1

cleanup() {
    local status=$?
    stop_engines
    if [[ -n $TRAINER_PID ]] && kill -0 "$TRAINER_PID" 2>/dev/null; then
        kill -TERM "$TRAINER_PID" 2>/dev/null || true
    fi
    exit "$status"
}
trap cleanup EXIT

# run_trainer SRUN_OPTIONS... -- BAPO_TRAIN_ARGS...: the trainer as an srun step in the background,
# waited for through signals (a trapped signal interrupts `wait`; the step goes on).
run_trainer() {
    local srun_args=()
    while [[ $1 != -- ]]; do
        srun_args+=("$1")
        shift
    done
    shift
    local command=(
        srun "${SRUN_COMMON[@]}" "${srun_args[@]}" --output="$LOG_DIR/trainer-%t.log"
        "$PYTHON" -m bapo_megatron.train "$CONFIG" "$@"
    )
    show "${command[@]}"
    "${command[@]}" & # srun itself: it passes USR1 and TERM on to every rank
    TRAINER_PID=$!
    local code=0
    while true; do
        code=0
        wait "$TRAINER_PID" || code=$?
        if ! kill -0 "$TRAINER_PID" 2>/dev/null; then
            break # the step ended (a signal interrupting `wait` leaves it running: wait again)
        fi
    done
    TRAINER_PID=""
    return "$code"
}

# The trainer's status.json: "finished", "stopped" (a signal: requeue), "failed" or "interrupted"
# (the job's error branch), or missing (it died before writing one).
run_state() {
    "$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["state"])' "$RUN_DIR/status.json" \
        2>/dev/null || echo missing
}

# After the trainer: requeue a stopped run (exit 0: this attempt did its part), fail on anything
# but a finished one. Prints nothing and returns 0 when the run finished.
requeue_or_finish() {
    local state
    state=$(run_state)
    case $state in
    finished) return 0 ;;
    stopped)
        echo "+ the run stopped at a checkpoint (signal $SIGNALLED): requeue job $SLURM_JOB_ID" >&2
        stop_engines
        run scontrol requeue "$SLURM_JOB_ID"
        exit 0
        ;;
    *)
        echo "error: the trainer ended without finishing (state: $state); see $LOG_DIR" >&2
        exit 1
        ;;
    esac
}

# export_hf TEMPLATE_DIR: the final checkpoint in Hugging Face format, RUN_DIR/hf.
export_hf() {
    local template=$1
    run srun "${SRUN_COMMON[@]}" --nodes=1 --ntasks=1 --output="$LOG_DIR/export.log" \
        "$PYTHON" tools/convert_checkpoint.py mcore-to-hf --mcore "$RUN_DIR/ckpt" --out "$RUN_DIR/hf" \
        --hf-template "$template" --no-progress
    echo "+ Hugging Face export: $RUN_DIR/hf" >&2
}

# --- the GPU job: engines on nodes of their own (or colocated), trainer, requeue, export ------

# bapo_gpu_job TRAIN_NODES ENGINES_PER_NODE ENGINE_TP [key=value ...]: the whole job of
# slurm/bapo_7b.sh and slurm/bapo_32b.sh: TRAIN_NODES trainer nodes (the environment's TRAIN_NODES
# wins), ENGINES_PER_NODE SGLang servers on each further node (likewise), ENGINE_TP the preset's
# rollout.engines.tensor_parallel; MODEL_DIR and DATA from the environment (a data.path=... argument
# stands for DATA, as the recipes' launch passes it); COLOCATE=1: no rollout nodes, the engines on
# every trainer node's GPUs (TRAIN_NODES x 8 / ENGINE_TP servers).
bapo_gpu_job() {
    TRAIN_NODES=${TRAIN_NODES:-$1}
    ENGINES_PER_NODE=${ENGINES_PER_NODE:-$2}
    local engine_tp=$3
    shift 3
    : "${MODEL_DIR:?set MODEL_DIR to the Hugging Face directory of the model (config, tokenizer, safetensors)}"
    if [[ -z ${DATA:-} ]] && ! has_override data.path "$@"; then
        echo "error: set DATA to the prompts (jsonl or parquet with prompt and answer fields), or pass data.path=..." >&2
        exit 2
    fi
    local gpus_per_node=8
    COLOCATE=${COLOCATE:-0}
    local nodes
    mapfile -t nodes < <(job_nodes)
    if ((${#nodes[@]} < TRAIN_NODES)); then
        echo "error: the job has ${#nodes[@]} nodes, the trainer needs TRAIN_NODES=$TRAIN_NODES" >&2
        exit 2
    fi
    local train_nodelist
    train_nodelist=$(IFS=,; echo "${nodes[*]:0:TRAIN_NODES}")
    local args=(
        "name=$SLURM_JOB_NAME"
        "model.hf_path=$MODEL_DIR"
        ${DATA:+"data.path=$DATA"} # (an argument data.path=... comes after these: it wins)
        "run_dir=$RUN_DIR"
        "checkpoint.dir=$RUN_DIR/ckpt"
        "rollout.engines.admin_key_file=$(shared_admin_key)"
    )
    if [[ $COLOCATE == 1 ]]; then
        # colocated engines give their memory to the trainer while it trains: generation is synchronous.
        # One server per ENGINE_TP GPUs on every trainer node, started by that node's first rank and
        # reached by the driver beyond loopback (the admin key above), weights by CUDA IPC on each node
        args+=("rollout.mode=sync" "rollout.engines.colocate=true" "rollout.engines.host=0.0.0.0"
            "rollout.engines.servers=$((TRAIN_NODES * gpus_per_node / engine_tp))")
    else
        if ((${#nodes[@]} == TRAIN_NODES)); then
            echo "error: no rollout nodes: submit with more than TRAIN_NODES=$TRAIN_NODES nodes, or COLOCATE=1" >&2
            exit 2
        fi
        local rollout_nodelist
        rollout_nodelist=$(IFS=,; echo "${nodes[*]:TRAIN_NODES}")
        ENGINE_SRUN=(--gpus-per-node="$gpus_per_node" --cpus-per-task=$((SLURM_CPUS_ON_NODE / ENGINES_PER_NODE)))
        start_engines "$rollout_nodelist" "$ENGINES_PER_NODE" 30000 "${args[@]}" "$@"
        args+=("rollout.engines.urls=$ENGINE_URLS" "rollout.sync.host=${nodes[0]}")
    fi
    trainer_rendezvous "${nodes[0]}"
    run_trainer --nodelist="$train_nodelist" --nodes="$TRAIN_NODES" --ntasks-per-node="$gpus_per_node" \
        --gpus-per-node="$gpus_per_node" -- "${args[@]}" "$@"
    requeue_or_finish
    stop_engines
    export_hf "$MODEL_DIR"
}
