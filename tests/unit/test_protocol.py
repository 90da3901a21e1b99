"""The protocol's parser and checks: malformed engine answers and bad values are clear errors."""

import base64
import math

import pytest
import torch

from bapo_megatron.common import protocol
from bapo_megatron.common.protocol import MalformedResponse, SamplingParams


def _good() -> dict:
    return protocol.generate_response(
        "r", [5, 6], [-0.5, -1.5], {"type": "stop", "matched": 6}, 3, "2", [("1", 0, 1), ("2", 1, 2)]
    )


def test_parser_reads_tokens_logprobs_and_versions():
    parsed = protocol.parse_generate_response([_good()], "r")  # a one-element batch is accepted too
    assert parsed.output_ids == [5, 6] and parsed.logprobs == [-0.5, -1.5] and parsed.finish == "stop"
    assert parsed.token_versions() == ["1", "2"] and parsed.prompt_tokens == 3


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b.pop("output_ids"), "no 'output_ids'"),
        (lambda b: b["meta_info"].update(finish_reason={"type": "oops"}), "finish_reason: expected a type in"),
        (lambda b: b["meta_info"]["output_token_logprobs"].pop(), "2 output ids but 1 output_token_logprobs"),
        (lambda b: b["meta_info"]["output_token_logprobs"][0].__setitem__(1, 9), "does not match token 5"),
        (lambda b: b["meta_info"]["output_token_logprobs"][1].__setitem__(0, None), "has no logprob"),
        (lambda b: b["meta_info"].update(weight_versions=[{"version": "1"}]), "weight_versions: bad span"),
        (lambda b: b.update(meta_info=[]), "meta_info: expected"),
        # values no model answers (once kept: 5.0 read as token 5, a log-prob above 0 trained on)
        (lambda b: b["output_ids"].__setitem__(0, 5.0), "output_ids: token id 5.0 is not an integer >= 0"),
        (lambda b: b["meta_info"]["output_token_logprobs"][1].__setitem__(0, 0.5), "log-prob 0.5 is not a finite"),
        (lambda b: b["meta_info"].update(prompt_tokens="3"), "prompt_tokens: expected an integer, got '3'"),
    ],
)
def test_malformed_responses_name_the_field(mutate, message):
    body = _good()
    mutate(body)
    with pytest.raises(MalformedResponse, match="/generate response for r") as err:
        protocol.parse_generate_response(body, "r")
    assert message in str(err.value)


def test_sampling_params_and_dtypes():
    with pytest.raises(ValueError, match=r"sampling_params.max_new_tokens=-1: must be an integer >= 0"):
        SamplingParams(max_new_tokens=-1)
    bad = {  # what once failed an engine step shared by every request in flight, or slipped through
        "temperature": (math.nan, math.inf, -1.0, "hot", True),
        "top_k": (2.5, 0, -2, "5"),
        "top_p": (0.0, 1.5, math.nan),
        "max_new_tokens": (1e9, math.nan, True, "7"),
        "sampling_seed": ("x", 1.5, -1),
        "stop_token_ids": (5, ["a"], [-1]),
        "ignore_eos": ("yes", 1),
    }
    for name, values in bad.items():
        for value in values:
            with pytest.raises(ValueError, match=rf"sampling_params\.{name}="):
                SamplingParams.from_json({"max_new_tokens": 4, name: value})
    greedy = SamplingParams.from_json({"max_new_tokens": 4, "temperature": 1e-41})  # SGLang: greedy below 1e-6
    assert greedy.temperature == 1e-41
    for name in ("temperature", "top_p"):  # JSON integers past float's range: once an OverflowError, unnamed
        with pytest.raises(ValueError, match=rf"sampling_params\.{name}=1000"):
            SamplingParams.from_json({"max_new_tokens": 4, name: 10**400})
    hot = SamplingParams.from_json({"max_new_tokens": 4, "temperature": 10**300, "top_p": 1})
    assert (hot.temperature, hot.top_p) == (1e300, 1.0) and type(hot.temperature) is type(hot.top_p) is float
    with pytest.raises(ValueError, match="top_p=1.5"):
        SamplingParams(max_new_tokens=1, top_p=1.5)
    with pytest.raises(ValueError, match=r"unsupported field\(s\) \['logit_bias'\]"):
        SamplingParams.from_json({"logit_bias": {}})
    assert SamplingParams.from_json({}).max_new_tokens == 128  # SGLang's default when unset
    assert protocol.torch_dtype(protocol.dtype_name(torch.bfloat16)) is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'float13'"):
        protocol.torch_dtype("float13")


def test_flattened_layout_offsets_and_alignment():
    assert protocol.flattened_layout([torch.float32, torch.bfloat16], [[2, 3], [5]]) == [(0, 24), (24, 34)]
    with pytest.raises(ValueError, match="a torch.float32 tensor would start at unaligned byte 10"):
        protocol.flattened_layout([torch.bfloat16, torch.float32], [[5], [1]])


def test_routed_experts_round_trip_compactly():
    """SGLang's format (base64 int32 [positions, layers, top_k], dense layers 0) decoded, kept as
    the MoE layers only in uint8 (int16 past 256 experts), and expanded back."""
    routes = torch.tensor([[[0, 0], [3, 1], [2, 0]], [[0, 0], [1, 2], [3, 2]]], dtype=torch.int32)
    text = protocol.encode_routed_experts(routes)
    decoded = protocol.routed_experts({"routed_experts": text}, num_layers=3, top_k=2)
    assert decoded.dtype == torch.int32 and torch.equal(decoded, routes)
    assert torch.equal(protocol.routed_experts(text, 3, 2), routes)  # Completion.routed_experts as it is
    compact = protocol.compact_routes(decoded, sparse_layers=(1, 2), num_experts=4)
    assert compact.dtype == torch.uint8 and compact.shape == (2, 2, 2)
    assert torch.equal(protocol.expand_routes(compact, 3, (1, 2)), routes)
    assert protocol.route_dtype(256) == torch.uint8 and protocol.route_dtype(257) == torch.int16
    wide = protocol.compact_routes(routes * 100, (1, 2), num_experts=301)
    assert wide.dtype == torch.int16 and int(wide.max()) == 300
    with pytest.raises(ValueError, match=r"expert ids in \[0, 3\], not \[0, 3\)"):
        protocol.compact_routes(routes, (1, 2), num_experts=3)
    assert protocol.routed_experts({"routed_experts": ""}, 3, 2).shape == (0, 3, 2)
    with pytest.raises(MalformedResponse, match="20 bytes are no whole number of positions"):
        protocol.routed_experts({"routed_experts": base64.b64encode(bytes(20)).decode()}, 3, 2)
    with pytest.raises(MalformedResponse, match="missing"):
        protocol.routed_experts({}, 3, 2)
    with pytest.raises(MalformedResponse, match="not base64"):
        protocol.routed_experts("%%%", 3, 2)


def test_routes_are_asked_for_and_carried_through_the_parser():
    sampling = SamplingParams(max_new_tokens=2)
    assert "return_routed_experts" not in protocol.generate_request([1, 2], sampling, "r")
    body = protocol.generate_request([1, 2, 3], sampling, "r", routed_experts_start_len=2)
    assert body["return_routed_experts"] is True and body["routed_experts_start_len"] == 2
    text = protocol.encode_routed_experts(torch.zeros(3, 3, 2, dtype=torch.int32))
    good = protocol.generate_response("r", [5, 6], [-0.5, -1.5], {"type": "length"}, 3, "2", [], text)
    assert protocol.parse_generate_response(good, "r").routed_experts == text
    assert protocol.parse_generate_response(_good(), "r").routed_experts is None
