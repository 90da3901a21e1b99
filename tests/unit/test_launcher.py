"""Engine server start-up: readiness, and the clear error (with the server's log tail) when a
server dies before it is ready, never becomes ready, or SGLang is missing."""

import sys
import types

import pytest

from bapo_megatron.config import load_config
from bapo_megatron.engines import sglang_launcher
from bapo_megatron.engines.launcher import EngineStartError, ServerProcess, embedded_server, free_port

pytestmark = pytest.mark.unit

# A server that answers 503 to its first `fails` polls of /health_generate, then 200.
FLAKY_SERVER = """
import http.server, sys
fails = int(sys.argv[2])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global fails
        code = 200 if fails <= 0 and self.path == "/health_generate" else 503
        fails -= 1
        self.send_response(code); self.end_headers()
    def log_message(self, *a):
        print("poll", self.path, flush=True)
print("listening", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _flaky(tmp_path, fails: int, name: str = "flaky") -> ServerProcess:
    port = free_port()
    return ServerProcess(
        [sys.executable, "-c", FLAKY_SERVER, str(port), str(fails)],
        f"http://127.0.0.1:{port}",
        tmp_path / f"{name}.log",
    )


def test_ready_after_some_unready_answers(tmp_path):
    server = _flaky(tmp_path, fails=3).start()
    try:
        assert server.wait_ready(30, path="/health_generate") is server
        assert server.log_tail().count("poll /health_generate") >= 4  # it waited through the 503s
    finally:
        server.stop()
    assert server.process.poll() is not None


def test_server_that_exits_reports_why(tmp_path):
    server = embedded_server(tmp_path / "no-such-model", tmp_path / "engine.log").start()
    with pytest.raises(EngineStartError, match="exited with code 2 before it was ready") as err:
        server.wait_ready(60)
    assert "no-such-model: no such directory" in str(err.value)  # the log's tail is in the message


@pytest.mark.parametrize(
    ("files", "problem"),
    [
        ({}, "no config.json"),
        ({"config.json": "{}", "pytorch_model.bin": "x"}, "no *.safetensors weights"),
    ],
)
def test_embedded_engine_refuses_a_model_dir_it_cannot_serve(tmp_path, capsys, files, problem):
    from bapo_megatron.engines.embedded.cli import main

    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert main(["--model", str(tmp_path), "--port", "1"]) == 2
    assert problem in capsys.readouterr().err


def test_server_never_ready_times_out_and_is_stopped(tmp_path):
    server = _flaky(tmp_path, fails=10**9).start()
    with pytest.raises(EngineStartError, match=r"not ready after 2 s; log tail:\nlistening") as err:
        server.wait_ready(2, path="/health_generate")
    assert "poll /health_generate" in str(err.value)
    assert server.process.poll() is not None  # not left running


def _sglang_cfg(**overrides):
    return load_config(
        None,
        [
            "rollout.engines.kind=sglang",
            "rollout.engines.servers=2",
            *(f"rollout.{k}={v}" for k, v in overrides.items()),
        ],
    ).rollout


def test_start_sglang_without_sglang_starts_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    with pytest.raises(RuntimeError, match=r"needs SGLang 0.5.23: pip install -e '.\[sglang\]'"):
        sglang_launcher.start_sglang(_sglang_cfg(), sglang_launcher.Launch("/models/qwen"), tmp_path)
    assert list(tmp_path.iterdir()) == []  # no config files, no processes


def test_start_sglang_stops_every_server_when_one_fails(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", types.ModuleType("sglang"))
    good = _flaky(tmp_path, fails=0, name="good")
    dead = ServerProcess(
        [sys.executable, "-c", "import sys; print('CUDA error: out of memory'); sys.exit(1)"],
        f"http://127.0.0.1:{free_port()}",
        tmp_path / "dead.log",
    )
    monkeypatch.setattr(sglang_launcher, "sglang_servers", lambda *a, **k: ([good, dead], None))
    with pytest.raises(EngineStartError, match="exited with code 1") as err:
        sglang_launcher.start_sglang(_sglang_cfg(), sglang_launcher.Launch("/models/qwen"), tmp_path, timeout_s=30)
    assert "CUDA error: out of memory" in str(err.value)
    assert good.process.poll() is not None  # the healthy server was stopped too


def test_another_jobs_server_on_the_port_is_never_taken_for_this_ones(tmp_path):
    """A port checked free, then taken by another job before this job's engine binds it: the other
    server answers /health but refuses this job's key, so waiting goes on until this job's engine
    exits (address in use) and the error says what happened, instead of a 401 at the first update."""
    from bapo_megatron.tasks import write_task

    model = write_task("addition", tmp_path / "task", train=10, heldout=5)["model"]
    theirs = embedded_server(model, tmp_path / "theirs.log", admin_key="their-key").start().wait_ready(120)
    try:
        port = int(theirs.url.rsplit(":", 1)[1])
        ours = embedded_server(model, tmp_path / "ours.log", port=port, admin_key="our-key").start()
        with pytest.raises(EngineStartError, match="refuses this job's key: the port is taken") as err:
            ours.wait_ready(120, key="our-key")
        assert "exited with code" in str(err.value) and ours.process.poll() is not None
        assert theirs.wait_ready(5, key="their-key") is theirs  # its owner's key is taken
        assert theirs.process.poll() is None
    finally:
        theirs.stop()


def test_two_runs_engines_take_free_ports_side_by_side(tmp_path):
    """Engines started without a port (the default) bind port 0 and report the port they got: two
    at once never collide."""
    from bapo_megatron.engines.launcher import embedded_servers
    from bapo_megatron.tasks import write_task

    model = write_task("addition", tmp_path / "task", train=10, heldout=5)["model"]
    ro = load_config(None, []).rollout
    assert ro.engines.port is None and ro.engines.first_port is None
    first = embedded_servers(ro, model, tmp_path / "run_a", seed=0, admin_key="a")[0]
    second = embedded_server(model, tmp_path / "run_b" / "engine_0.log", admin_key="b")
    try:
        assert first.url is None and "--port-file" in first.command  # known once it reports it
        for server in (first.start(), second.start()):
            server.wait_ready(120, key=server.env["BAPO_ADMIN_API_KEY"])
        assert first.url != second.url and all(s.url.startswith("http://127.0.0.1:") for s in (first, second))
    finally:
        first.stop()
        second.stop()


# A server that binds the port it is given (0: a free one) and reports it as the embedded engine does.
PORT_FILE_SERVER = """
import http.server, os, sys
port, port_file = int(sys.argv[sys.argv.index("--port") + 1]), None
if "--port-file" in sys.argv:
    port_file = sys.argv[sys.argv.index("--port-file") + 1]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
server = http.server.HTTPServer(("127.0.0.1", port), H)
if port_file:
    open(port_file + ".partial", "w").write(str(server.server_address[1]))
    os.replace(port_file + ".partial", port_file)
server.serve_forever()
"""


def test_a_restarted_server_comes_back_on_the_free_port_it_got(tmp_path):
    """The URL clients hold stays right: after the first start the command names the port."""
    port_file = tmp_path / "server.log.port"
    command = [sys.executable, "-c", PORT_FILE_SERVER, "--port", "0", "--port-file", str(port_file)]
    server = ServerProcess(command, None, tmp_path / "server.log", port_file=port_file)
    try:
        url = server.start().wait_ready(30).url
        assert url.startswith("http://127.0.0.1:") and not port_file.exists()
        assert server.command[-2:] == ["--port", url.rsplit(":", 1)[1]]  # pinned, no port file
        server.kill()
        assert server.start().wait_ready(30).url == url
    finally:
        server.stop()


def test_the_banner_and_the_dry_run_say_a_free_port():
    from bapo_megatron import cli
    from bapo_megatron.errors import ConfigError
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.runinfo import banner

    free = load_config(None, ["rollout.engines.servers=2"])
    assert "2 embedded engines on a free port each of 127.0.0.1" in banner(free, tiny_spec(), 1, None)
    assert "a free port each" in cli.dry_run(free, 1, 80 * 2**30)
    assert load_config(None, ["rollout.engines.port=0"]).rollout.engines.first_port is None
    assert load_config(None, ["rollout.engines.kind=sglang"]).rollout.engines.first_port == 30000  # SGLang's
    fixed = load_config(None, ["rollout.engines.port=31000"])
    assert "1 embedded engine on 127.0.0.1:31000" in banner(fixed, tiny_spec(), 1, None)
    with pytest.raises(ConfigError, match="rollout.engines.port=-1"):
        load_config(None, ["rollout.engines.port=-1"])


def test_bapo_serve_keeps_a_fixed_port(tmp_path):
    """The trainer is handed bapo-serve's URLs beforehand: an engine there takes no free port, but
    30000 + its index where the config sets none."""
    from bapo_megatron.serve import engine_server

    server = engine_server(load_config(None, [f"model.hf_path={tmp_path}", "rollout.engines.servers=2"]), 1, tmp_path)
    assert server.url == "http://127.0.0.1:30001" and "--port-file" not in server.command
