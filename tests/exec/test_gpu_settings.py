"""GPU settings are decided and checked in the driver before any actor starts (issue 20, item 2): no GPU needed.

Each "will crash" case of the static review is here: gpus_per_actor 0 for vLLM on a GPU cluster (an empty
CUDA_VISIBLE_DEVICES), tensor_parallel_size above gpus_per_actor ("World size larger than available GPUs"), two engines
on one GPU each reserving vLLM's default 0.9 of its memory, and a cluster with no GPU yet (min_workers 0)."""

from __future__ import annotations

import pytest

from pipeline.core.errors import ConfigError, ResourceError
from pipeline.exec.gpu import plan_gpus
from pipeline.exec.ray_pool import wait_for_gpus


def test_vllm_on_a_gpu_cluster_gets_one_gpu_per_actor_by_default():
    plan = plan_gpus("vllm", {"model": "m"}, 0.0, cluster_gpus=8)
    assert plan.gpus_per_actor == 1.0 and plan.agent_options == {"model": "m"} and "defaults" in plan.note


def test_the_default_follows_tensor_parallel_size():
    assert plan_gpus("vllm", {"model": "m", "tensor_parallel_size": 4}, 0.0, cluster_gpus=8).gpus_per_actor == 4.0


def test_vllm_on_a_cpu_cluster_stays_on_cpus():
    assert plan_gpus("vllm", {"model": "m"}, 0.0, cluster_gpus=0).gpus_per_actor == 0.0


def test_the_cuda_build_on_a_cluster_without_gpus_yet_expects_them():
    """cluster/gpu-vllm.yaml starts with no GPU node (min_workers 0): with the CUDA build of vLLM the default is still
    one GPU per actor, which the driver then waits for, rather than a CUDA engine on a GPU node with num_gpus=0."""
    plan = plan_gpus("vllm", {"model": "m"}, 0.0, cluster_gpus=0, expect_gpus=True)
    assert plan.gpus_per_actor == 1.0 and "still to come" in plan.note


def test_other_agents_are_left_alone():
    plan = plan_gpus("transformers", {"model": "m"}, 0.0, cluster_gpus=8)
    assert plan.gpus_per_actor == 0.0 and plan.note is None


def test_fewer_gpus_than_tensor_parallel_ranks_is_one_line():
    with pytest.raises(ConfigError, match=r"gpus_per_actor=1 but tensor_parallel_size=2: .* at least 2$") as info:
        plan_gpus("vllm", {"model": "m", "tensor_parallel_size": 2}, 1.0, cluster_gpus=8)
    assert info.value.exit_code == 2 and "\n" not in str(info.value)


def test_a_fraction_above_one_gpu_is_refused():
    with pytest.raises(ConfigError, match="whole number of GPUs"):
        plan_gpus("vllm", {"model": "m"}, 1.5, cluster_gpus=8)


def test_fractional_gpus_scale_gpu_memory_utilization():
    plan = plan_gpus("vllm", {"model": "m"}, 0.5, cluster_gpus=1)
    assert plan.gpus_per_actor == 0.5 and plan.agent_options["gpu_memory_utilization"] == pytest.approx(0.45)
    quarter = plan_gpus("vllm", {"model": "m"}, 0.25, cluster_gpus=1)
    assert quarter.agent_options["gpu_memory_utilization"] == pytest.approx(0.225)
    # an explicit share that fits is kept
    assert plan_gpus("vllm", {"model": "m", "gpu_memory_utilization": 0.3}, 0.5, 1).agent_options[
        "gpu_memory_utilization"] == 0.3


def test_an_explicit_memory_share_too_big_for_a_fraction_is_one_line():
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=0\.9 with gpus_per_actor=0\.5: the 2 engines"):
        plan_gpus("vllm", {"model": "m", "gpu_memory_utilization": 0.9}, 0.5, cluster_gpus=1)


def test_the_driver_waits_for_the_autoscaler_and_withdraws_its_request():
    """A unit test of the waiting loop: the cluster gains its GPU node on the third look."""
    looks, requests, t = iter([{}, {"CPU": 4}, {"CPU": 12, "GPU": 1}]), [], [0.0]
    have = wait_for_gpus([{"GPU": 1, "CPU": 1}], 600, cluster_resources=lambda: next(looks),
                         request=lambda bundles: requests.append(bundles),
                         sleep=lambda s: t.__setitem__(0, t[0] + s), clock=lambda: t[0])
    assert have == 1 and requests == [[{"GPU": 1, "CPU": 1}], []] and t[0] == 10.0


def test_no_gpu_after_the_timeout_is_one_line():
    requests, t = [], [0.0]
    with pytest.raises(ResourceError, match=r"need 2 GPUs but the cluster still has 0 after waiting 30 s") as info:
        wait_for_gpus([{"GPU": 1}] * 2, 30, cluster_resources=dict, request=lambda bundles: requests.append(bundles),
                      sleep=lambda s: t.__setitem__(0, t[0] + s), clock=lambda: t[0])
    assert requests[-1] == [] and "\n" not in str(info.value)


@pytest.mark.ray
def test_a_gpu_pool_on_a_cluster_without_gpus_asks_the_autoscaler_then_fails_in_one_line(ray_session, caplog):
    """Real Ray (no GPU here, no autoscaler): the request goes through Ray's SDK and the driver gives up after the
    stated timeout, before any actor starts; before issue 20 it raised at once and never asked for a node."""
    from pipeline.agents import AgentSpec
    from pipeline.audit.actors import start_agent_pool

    with pytest.raises(ResourceError, match="after waiting 2 s for the autoscaler") as info:
        start_agent_pool(AgentSpec("reader", {}), actors=1, gpus_per_actor=1.0, gpu_wait_s=2)
    assert "\n" not in str(info.value)
    assert any("asked the autoscaler" in r.getMessage() for r in caplog.records)


def test_cuda_engines_get_a_float32_head_unless_quantised_or_float32(tmp_path):
    import json

    from pipeline.agents.vllm_agent import head_overrides

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert head_overrides(str(tmp_path), on_cpu=False, dtype="bfloat16") == {"head_dtype": "float32"}
    assert head_overrides(str(tmp_path), on_cpu=False, dtype="auto") == {"head_dtype": "float32"}
    assert head_overrides(str(tmp_path), on_cpu=True, dtype="bfloat16") is None  # CPU fingerprints unchanged
    assert head_overrides(str(tmp_path), on_cpu=False, dtype="float32") is None
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}}))
    assert head_overrides(str(tmp_path), on_cpu=False, dtype="bfloat16") is None
