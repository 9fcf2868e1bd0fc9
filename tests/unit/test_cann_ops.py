"""cann_ops: the graph-mode operator set and the kernels read from the installed onnxruntime-cann
library, and the check of a model against the operators Ascend's ONNX parser documents."""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from tiny_mindie.model.onnx import cann_ops
from tiny_mindie.model.onnx.cann_ops import (
    LIB_SOURCE,
    SUPPORTED,
    check_model,
    graph_mode_ops,
    placement_in_graph_mode,
    registered_kernels,
)

#: setup.cfg installs onnxruntime-cann, which carries the provider library, only here.
needs_library = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64")
    or sys.version_info >= (3, 14),
    reason="onnxruntime-cann installs on Linux x86_64/aarch64, CPython < 3.14 only")

#: ``cann_supported_ops`` of SupportONNXModel, onnxruntime/core/providers/cann/cann_graph.cc.
SOURCE_LIST = frozenset("""
    Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization
    BitShift Cast Ceil Celu Clip Compress Concat Constant ConstantOfShape Conv ConvTranspose Cos
    Cosh CumSum DepthToSpace Det Div Dropout Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather
    GatherElements GatherND Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool Greater
    GreaterOrEqual Hardmax HardSigmoid HardSwish Identity InstanceNormalization LeakyRelu Less
    LessOrEqual Log LogSoftmax LpNormalization LpPool LRN LSTM MatMul Max MaxPool MaxRoiPool
    MaxUnpool Mean MeanVarianceNormalization Min Mod Mul Multinomial Neg NonMaxSuppression NonZero
    Not OneHot Or Pad Pow PRelu RandomNormalLike RandomUniform RandomUniformLike Range Reciprocal
    ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd
    ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RoiAlign Round Scatter
    ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax
    SoftmaxCrossEntropyLoss Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tanh
    TfIdfVectorizer ThresholdedRelu Tile TopK Transpose Unsqueeze Where Xor""".split())

#: The operators the standard graph may use.
STANDARD_OPS = """Gather Reshape Transpose Concat Slice Split Shape Unsqueeze Squeeze Expand
    Identity MatMul Gemm Add Sub Mul Div Neg Sqrt Reciprocal Pow ReduceMean ReduceSum Softmax
    Sigmoid Tanh ScatterND Where Cast Equal Less Range ConstantOfShape""".split()


def _vi(name: str, elem: int, shape) -> onnx.ValueInfoProto:
    return h.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, inits=(), opset=17, ir=8, extra=()) -> onnx.ModelProto:
    graph = h.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset), *extra])
    model.ir_version = ir
    return model


def _valid_model() -> onnx.ModelProto:
    """float32 through Transpose, Sigmoid, Softmax, Add, Gather (int64 indices), Mul."""
    b = numpy_helper.from_array(np.ones((3, 2), np.float32), "b")
    nodes = [h.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
             h.make_node("Sigmoid", ["t"], ["s"]),
             h.make_node("Softmax", ["s"], ["sm"], axis=-1),
             h.make_node("Add", ["sm", "b"], ["a"]),
             h.make_node("Gather", ["a", "idx"], ["g"], axis=0),
             h.make_node("Mul", ["g", "g"], ["y"])]
    return _model(nodes, [_vi("x", T.FLOAT, [2, 3]), _vi("idx", T.INT64, [2])],
                  [_vi("y", T.FLOAT, [2, 2])], [b])


def _one(problems: list[str], *parts: str) -> str:
    """The one problem line holding every part (fails when none does)."""
    found = [p for p in problems if all(part in p for part in parts)]
    assert found, f"no problem with {parts} in {problems}"
    return found[0]


@needs_library
def test_graph_mode_set_is_the_sources_list():
    ops = graph_mode_ops()
    assert ops == SOURCE_LIST and len(ops) == 134
    claimed = [op for op, entry in SUPPORTED.items() if LIB_SOURCE in entry.sources]
    assert claimed and set(claimed) <= ops
    assert "ScatterND" in ops
    assert not ops & {"GroupQueryAttention", "MatMulNBits", "SimplifiedLayerNormalization",
                      "Einsum", "Trilu", "If", "Loop"}


@needs_library
def test_graph_mode_set_holds_the_names_the_linker_merged_into_others():
    spec = importlib.util.find_spec("onnxruntime")
    capi = os.path.join(list(spec.submodule_search_locations)[0], "capi")
    with open(os.path.join(capi, cann_ops.LIBRARY), "rb") as f:
        data = f.read()
    start = data.find(b"Abs\0Acos\0Acosh\0Add\0")
    run = data[start:data.find(b"\0Xor\0", start) + 5]
    merged = {"Mul", "MatMul", "Sigmoid", "Softmax", "Shape", "Transpose", "Equal", "Sum"}
    assert not [m for m in merged if b"\0" + m.encode() + b"\0" in run]
    assert merged <= graph_mode_ops()


@needs_library
def test_registered_kernels_parse_the_symbols():
    kernels = registered_kernels()
    assert {("MatMul", 13, None, "float"), ("Add", 7, 12, "float"), ("Add", 14, None, "MLFloat16"),
            ("Cast", 13, None, "int64_t"), ("Identity", 14, 18, ""),
            ("Dropout", 12, 12, "float_float")} <= kernels
    assert 200 <= len(kernels) <= 400
    ops = {k[0] for k in kernels}
    assert 25 <= len(ops) <= 40
    assert ops - graph_mode_ops() == {"MemcpyFromHost", "MemcpyToHost"}
    assert not [k for k in kernels if k[2] is not None and k[2] < k[1]]


def test_an_absent_library_is_file_not_found(tmp_path):
    for read in (graph_mode_ops, registered_kernels):
        with pytest.raises(FileNotFoundError):
            read(tmp_path / "missing.so")


def test_a_file_that_is_not_a_library(tmp_path):
    path = tmp_path / cann_ops.LIBRARY
    path.write_bytes(b"Abs\0Acos\0Acosh\0Add\0" * 10)
    with pytest.raises(ValueError, match="ELF"):
        graph_mode_ops(path)
    assert registered_kernels(path) == frozenset()


def test_supported_covers_the_standard_graph_with_sources():
    assert not [op for op in STANDARD_OPS if op not in SUPPORTED]
    for op, entry in SUPPORTED.items():
        pages = [s for s in entry.sources if s.startswith("CANN ")]
        assert pages and all("https://www.hiascend.com/" in s for s in pages), op
        assert entry.versions and min(entry.versions) >= 8, op
        assert onnx.defs.has(op), op


def test_documents_reads_the_pages_lists():
    assert SUPPORTED["Softmax"].documents(17, 13)
    assert not SUPPORTED["Sub"].documents(17, 14)          # Sub: v8-v15
    assert not SUPPORTED["Unsqueeze"].documents(17, 13)    # Unsqueeze: v8-v12
    assert SUPPORTED["Unsqueeze"].documents(11, 11)
    assert SUPPORTED["ConstantOfShape"].documents(12, 9)


def test_a_valid_model_passes():
    assert check_model(_valid_model()) == []


def test_a_com_microsoft_node_is_flagged():
    model = _valid_model()
    model.graph.node.append(h.make_node("FastGelu", ["y"], ["z"], domain="com.microsoft"))
    model.opset_import.append(h.make_opsetid("com.microsoft", 1))
    assert _one(check_model(model), "node 6", "com.microsoft:FastGelu", "default ONNX domain")


def test_an_operator_outside_the_list_is_flagged():
    model = _valid_model()
    model.graph.node.append(h.make_node("Einsum", ["y", "y"], ["z"], equation="ij,ij->ij"))
    assert _one(check_model(model), "ai.onnx:Einsum", "cann_ops.SUPPORTED")


def test_a_data_type_the_page_omits_is_flagged():
    nodes = [h.make_node("Softmax", ["x"], ["y"], axis=-1)]
    model = _model(nodes, [_vi("x", T.DOUBLE, [2, 3])], [_vi("y", T.DOUBLE, [2, 3])])
    assert check_model(model) == []                 # Softmax takes double (CANN 8.5.0 page)
    nodes = [h.make_node("Sigmoid", ["x"], ["y"])]
    model = _model(nodes, [_vi("x", T.DOUBLE, [2, 3])], [_vi("y", T.DOUBLE, [2, 3])])
    line = _one(check_model(model), "Sigmoid", "input 0 (x) is double")
    assert "documented: float, float16" in line


def test_matmul_float32_is_cast_and_cast_to_int64_is_flagged():
    """MatMul's page lists float16 only: float32 inputs pass, cast by the precision mode the
    provider is given (allow_fp32_to_fp16); double does not, nor a Cast to int64."""
    nodes = [h.make_node("MatMul", ["x", "w"], ["m"]),
             h.make_node("Cast", ["m"], ["y"], to=T.INT64)]
    w = numpy_helper.from_array(np.ones((3, 4), np.float32), "w")
    model = _model(nodes, [_vi("x", T.FLOAT, [2, 3])], [_vi("y", T.INT64, [2, 4])], [w])
    problems = check_model(model)
    _one(problems, "Cast", "output 0 (y) is int64")
    assert len(problems) == 1
    nodes = [h.make_node("MatMul", ["x", "x"], ["y"])]
    model = _model(nodes, [_vi("x", T.DOUBLE, [2, 2])], [_vi("y", T.DOUBLE, [2, 2])])
    _one(check_model(model), "MatMul", "input 0 (x) is double", "documented: float, float16")


def test_dtype_report_says_per_node_kind_whether_the_pages_list_its_types():
    """float16 MatMul: on its page; float32 MatMul: accepted, narrowed to float16 by the
    precision mode; a Cast to int64 and an operator the list lacks: not accepted."""
    w16 = numpy_helper.from_array(np.ones((3, 4), np.float16), "w16")
    w32 = numpy_helper.from_array(np.ones((3, 4), np.float32), "w32")
    nodes = [h.make_node("Cast", ["x"], ["x16"], to=T.FLOAT16),
             h.make_node("MatMul", ["x16", "w16"], ["m16"]),
             h.make_node("MatMul", ["x", "w32"], ["m32"]),
             h.make_node("Cast", ["m16"], ["i"], to=T.INT64),
             h.make_node("Erf", ["m32"], ["y"])]
    model = _model(nodes, [_vi("x", T.FLOAT, [2, 3])], [_vi("i", T.INT64, [2, 4]),
                                                        _vi("y", T.FLOAT, [2, 4])], [w16, w32])
    kinds = {k.op_type: k for k in cann_ops.dtype_report(model)}
    assert list(kinds) == ["Cast", "MatMul", "Erf"]
    assert kinds["MatMul"] == cann_ops.KindTypes("MatMul", 2, ("float", "float16"), True, True)
    assert kinds["Cast"].nodes == 2 and not kinds["Cast"].accepted       # the int64 output
    assert kinds["Cast"].types == ("float", "float16", "int64")
    assert kinds["Erf"] == cann_ops.KindTypes("Erf", 1, (), False, False)
    nodes = [h.make_node("MatMul", ["x", "w16"], ["y"])]
    model = _model(nodes, [_vi("x", T.FLOAT16, [2, 3])], [_vi("y", T.FLOAT16, [2, 4])], [w16])
    assert cann_ops.dtype_report(model) == [
        cann_ops.KindTypes("MatMul", 1, ("float16",), True, False)]


def test_versions_inputs_and_opsets_outside_the_pages_are_flagged():
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    c = numpy_helper.from_array(np.ones((2,), np.float32), "c")
    nodes = [h.make_node("Unsqueeze", ["x", "axes"], ["u"]),
             h.make_node("Gemm", ["x", "x", "c"], ["y"], transB=1)]
    model = _model(nodes, [_vi("x", T.FLOAT, [2, 2])], [_vi("y", T.FLOAT, [2, 2])], [axes, c])
    problems = check_model(model)
    _one(problems, "Unsqueeze", "opset 17 (operator version 13)", "8-12")
    _one(problems, "Gemm", "more inputs than the documented 2")
    model = _valid_model()
    model.opset_import[0].version, model.ir_version = 21, 10
    problems = check_model(model)
    _one(problems, "model: default-domain opset 21", "9-18")
    _one(problems, "model: IR version 10")
    _one(problems, "Softmax", "opset 21")


def test_types_come_from_constants_and_unloaded_external_data(tmp_path):
    big = numpy_helper.from_array(np.ones((64, 64), np.float64), "big")
    nodes = [h.make_node("Constant", [], ["k"], value_float=2.0),
             h.make_node("Softmax", ["big"], ["s"]),
             h.make_node("Sigmoid", ["k"], ["y"])]
    model = _model(nodes, [], [_vi("s", T.DOUBLE, [64, 64]), _vi("y", T.FLOAT, [])], [big])
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, size_threshold=0)
    loaded = onnx.load(tmp_path / "m.onnx", load_external_data=False)
    assert not loaded.graph.initializer[0].raw_data
    problems = check_model(loaded)
    _one(problems, "Constant", "opset 17 (operator version 13)", "8-13")
    assert not [p for p in problems if "Softmax" in p or "Sigmoid" in p]
    loaded.graph.node[2].op_type = "Sqrt"
    loaded.graph.node[1].op_type = "Sigmoid"
    _one(check_model(loaded), "Sigmoid", "input 0 (big) is double")


def test_a_thousand_node_model_is_checked_quickly():
    nodes = [h.make_node("Sigmoid" if i % 2 else "Neg", [f"t{i}"], [f"t{i + 1}"])
             for i in range(1000)]
    model = _model(nodes, [_vi("t0", T.FLOAT, [4, 8])], [_vi("t1000", T.FLOAT, [4, 8])])
    started = time.perf_counter()
    assert check_model(model) == []
    assert time.perf_counter() - started < 10


def _placement_model(opset: int = 17) -> onnx.ModelProto:
    w1 = numpy_helper.from_array(np.ones((2,), np.float32), "w1")
    w2 = numpy_helper.from_array(np.ones((2,), np.float32), "w2")
    nodes = [h.make_node("Constant", [], ["c"], value_float=2.0),
             h.make_node("Mul", ["x", "c"], ["m"]),                   # taken
             h.make_node("Add", ["w1", "w2"], ["w"]),                 # all initializers: left
             h.make_node("FastGelu", ["m"], ["f"], domain="com.microsoft"),   # domain: left
             h.make_node("Add", ["f", "w"], ["a"]),                   # taken
             h.make_node("Softmax", ["a"], ["s"]),                    # taken
             h.make_node("Einsum", ["s", "s"], ["y"], equation="i,i->i")]     # operator: left
    return _model(nodes, [_vi("x", T.FLOAT, [2])], [_vi("y", T.FLOAT, [2])], [w1, w2],
                  opset=opset, extra=[h.make_opsetid("com.microsoft", 1)])


@needs_library
def test_placement_follows_support_onnx_model():
    placed = placement_in_graph_mode(_placement_model())
    assert placed == {"opset": 17, "nodes": 6, "constant_nodes": 1, "taken": 3, "left": 3,
                      "left_by_reason": {"all_initializers": 1, "domain": 1, "operator": 1},
                      "left_ops": {"ai.onnx:Add": 1, "com.microsoft:FastGelu": 1,
                                   "ai.onnx:Einsum": 1},
                      "partitions": 2, "all_taken": False}
    assert placement_in_graph_mode(_valid_model())["all_taken"]


def test_placement_below_opset_8_takes_nothing():
    placed = placement_in_graph_mode(_placement_model(opset=7), ops=SOURCE_LIST)
    assert placed["taken"] == 0 and placed["partitions"] == 0
    assert placed["left_by_reason"] == {"domain": 1, "opset": 5}
