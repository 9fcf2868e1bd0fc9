"""Execution providers and threads (tiny_mindie/model/ort/providers.py)."""

from __future__ import annotations

import os

from tiny_mindie.model.ort import providers
from tiny_mindie.model.ort.providers import select_providers


def test_providers_fall_back_to_cpu_silently(monkeypatch, capfd):
    monkeypatch.setattr(providers, "ascend_available", lambda: False)
    assert select_providers() == ["CPUExecutionProvider"]
    monkeypatch.setattr(providers, "ascend_available", lambda: True)
    chosen = select_providers(device_id=3)
    assert chosen[0] == ("CANNExecutionProvider", {"device_id": "3", "dump_om_model": "0",
                                                   "precision_mode": "allow_fp32_to_fp16"})
    assert select_providers(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_default_threads_are_every_cpu_of_the_process():
    assert providers.default_threads() == len(os.sched_getaffinity(0))


def test_node_placement_counts_the_nodes_each_provider_runs():
    """onnxruntime records which provider took which node of the optimized graph: a graph of
    a MatMul (float) and a Sigmoid, with the project's session options, on the CPU provider."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]),
         helper.make_node("Sigmoid", ["y"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers.session_options(1, spinning=False),
                                   providers=[providers.CPU])
    counts = providers.node_placement(session)
    assert counts == {providers.CPU: 2}
    assert providers.ops_by_provider(session) == {providers.CPU: {"MatMul": 1, "Sigmoid": 1}}
    assert providers.placement_summary(counts) == "CPU 2 nodes"
    assert providers.placement_summary({"CANNExecutionProvider": 950, providers.CPU: 57}) == \
        "CANN 950, CPU 57 nodes"
    assert providers.placement_summary({}) == "not reported"
    ops = {"CANNExecutionProvider": {"MatMul": 950}, providers.CPU: {"Gather": 50, "Shape": 7}}
    assert providers.placement_summary({"CANNExecutionProvider": 950, providers.CPU: 57}, ops) \
        == "CANN 950, CPU 57 nodes (CPU: Gather 50, Shape 7)"


def test_auto_graph_is_standard_on_cann_only(monkeypatch):
    cann = [("CANNExecutionProvider", {"device_id": "0"}), providers.CPU]
    assert providers.graph_flavour("auto", cann) == "contrib"    # Ascend's runtime is not here
    monkeypatch.setattr(providers, "ascend_available", lambda: True)
    assert providers.graph_flavour("auto", cann) == "standard"
    assert providers.graph_flavour("auto", [providers.CPU]) == "contrib"
    assert providers.graph_flavour("standard", [providers.CPU]) == "standard"
    assert providers.graph_flavour("contrib", ["CANNExecutionProvider"]) == "contrib"
