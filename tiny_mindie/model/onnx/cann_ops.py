"""Which ONNX operators the CANN execution provider's graph mode can take, and a check of a model
against them, for the standard graph (:mod:`.graph_standard`: default-domain operators only,
IR version 8, opset 17).

Graph mode in onnxruntime-cann 1.24.4 (``enable_cann_graph``, on by default: ``int
enable_cann_graph{1}`` in include/onnxruntime/core/providers/cann/cann_provider_options.h of
microsoft/onnxruntime; "Default value: true" on
https://onnxruntime.ai/docs/execution-providers/community-maintained/CANN-ExecutionProvider.html):
``SupportONNXModel`` (onnxruntime/core/providers/cann/cann_graph.cc) leaves a node out unless it
is in the default domain, the model's default-domain opset is at least 8, its op type is one of
134 names (:func:`graph_mode_ops`) and not all its inputs are initializers. ``GetCapability``
then claims the whole graph as one subgraph; only with ``enable_cann_subgraph`` (off by default,
same header) one per run of taken nodes -- the installed library's ``GetCapability`` tests that
flag before ``GetSubGraphPartition`` (its disassembly), so by default every node, left out or
not, goes to Ascend's parser. ``Compile`` (cann_execution_provider.cc) keeps each subgraph as
ONNX; the first run with a new set of input shapes parses it (``aclgrphParseONNXFromMem``),
builds it with ``INPUT_SHAPE`` set to those shapes (``BuildONNXModel``) and caches the model
under a hash of the shapes (also as ``<name>_<hash>.om``: ``dump_om_model`` is on by default).

Ascend's ONNX parser documents each operator (opsets, input data types) in the "支持ONNX算子清单"
pages of the CANN documentation, cited per operator in :data:`SUPPORTED`. They name ONNX 1.12.0
(IR version 8, opset 17 in ``onnx.helper.VERSION_TABLE``); ATC in CANN 7.0.0 "Opset版本为v9~v18"
(https://www.hiascend.com/document/detail/zh/canncommercial/700/inferapplicationdev/atctool/atlasatc_16_0201.html);
from CANN 8.0 each operator's page gives its opsets, and the list covers the Atlas inference
series (https://hiascend.com/document/detail/zh/canncommercial/80RC22/apiref/operatorlist/operatorlist_0004.html).

Precision: the float16 standard graph (the default) hands ``MatMul`` and ``Gemm`` float16
operands and keeps float32 where an operator's page lists float32 (:mod:`.graph_standard`);
the float32 graph computes in float32. Either way the session asks the CANN provider for
``precision_mode`` :data:`.providers.CANN_PRECISION_MODE` (:func:`.providers.select_providers`),
with which ATC "keeps fp32 where an operator supports it, else chooses fp16"
(https://www.hiascend.com/document/detail/zh/canncommercial/601/devtools/auxiliarydevtool/aoepar_16_044.html,
CANN 6.0.1; ATC's own default is force_fp16). So a float32 input of an operator whose page
lists float16 but not float32 (``MatMul``) is accepted: it is computed in float16 on the NPU.

Verified here: the graph-mode set, read from the installed library (equal to the source's
list), and the library's single-operator kernels (:func:`registered_kernels`). Not verifiable
without Ascend hardware: whether the pages are complete and current (Reshape's 8.x pages leave
out float32, which 6.0.1 lists) and whether a graph that passes :func:`check_model` compiles.
"""

from __future__ import annotations

import importlib.util
import os
import re
import struct
from collections import Counter
from dataclasses import dataclass
from functools import cache

import onnx

ASCEND_OPSETS = (9, 18)   #: the model opsets ATC documents (CANN 7.0.0, module docstring)
ASCEND_IR_VERSION = 8     #: ONNX 1.12.0's IR version, the ONNX release Ascend's pages name
GRAPH_MODE_MIN_OPSET = 8  #: ``lower_bound`` in cann_graph.cc
LIBRARY = "libonnxruntime_providers_cann.so"
LIB_SOURCE = "onnxruntime-cann 1.24.4 graph-mode list"
EVERY_INPUT = -1          #: an input index standing for all of a node's inputs
_DEFAULT_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class OpSupport:
    """What Ascend documents of one operator.

    versions: the model opsets its page lists. inputs / outputs: (index, allowed ONNX element
    type names such as ``"float"`` or ``"int64"``) pairs, index :data:`EVERY_INPUT` for all.
    max_inputs: inputs the page supports, None for no limit. sources: URLs with their CANN
    version, and :data:`LIB_SOURCE` where the library's graph-mode set holds the operator."""

    versions: frozenset[int]
    inputs: tuple[tuple[int, frozenset[str]], ...]
    outputs: tuple[tuple[int, frozenset[str]], ...] = ()
    max_inputs: int | None = None
    notes: str = ""
    sources: tuple[str, ...] = ()

    def documents(self, opset: int, since: int) -> bool:
        """Whether the page covers a model of default-domain ``opset`` (int) whose operator
        version there is ``since`` (int): the opset is listed, and so is ``since`` unless it is
        older than the first listed opset. Returns bool; raises nothing."""
        return opset in self.versions and (since in self.versions or since < min(self.versions))


_PAGES = {   # key: (CANN version, page path under https://www.hiascend.com/)
    "en850": ("8.5.0", "document/detail/en/canncommercial/850/API/aolapi/atlasoxol_09_{}.html"),
    "zh850": ("8.5.0", "document/detail/zh/canncommercial/850/API/aolapi/atlasoxol_09_{}.html"),
    "dc850": ("8.5.0", "doc_center/source/zh/canncommercial/850/API/aolapi/atlasoxol_09_{}.html"),
    "zh800": ("8.0.0", "document/detail/zh/canncommercial/800/apiref/aolapi/atlasoxol_09_{}.html"),
    "dc800": ("8.0.0", "doc_center/source/zh/canncommercial/800/apiref/aolapi/"
                       "atlasoxol_09_{}.html"),
    "zh900": ("9.0.0", "document/detail/zh/canncommercial/900/API/aolapi/atlasoxol_09_{}.html"),
    "md900": ("9.0.0", "llms-content/document/detail/canncommercial/"
                       "canncommercial_900_API_aolapi_atlasoxol_09_{}_html.md"),
    "zh601": ("6.0.1", "document/detail/zh/canncommercial/601/oplist/fwoperator/"
                       "atlasoxol_09_{}.html"),
}


def _src(key: str, page: str) -> str:
    version, path = _PAGES[key]
    return f"CANN {version}: https://www.hiascend.com/{path.format(page)}"


def _v(lo: int, hi: int) -> frozenset[int]:
    return frozenset(range(lo, hi + 1))


def _t(*names: str) -> frozenset[str]:
    return frozenset(names)


def _op(page: str, versions: frozenset[int], inputs: tuple, **kw) -> OpSupport:
    key, _, number = page.partition(":")
    return OpSupport(versions, inputs, sources=(_src(key, number), LIB_SOURCE), **kw)


F16, F32, I32_64 = _t("float16"), _t("float16", "float"), _t("int32", "int64")
_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
ALL_NUM = _t("float16", "float", *_INTS)
ANY = ALL_NUM | _t("bool", "double")
_WHERE_X = F32 | _t("uint8", "int8", "int32")

#: op_type -> what Ascend documents; every op of the standard graph, at its opset
#: (:data:`.graph_standard.OPSET`).
SUPPORTED: dict[str, OpSupport] = {
    "Gather": _op("en850:0062", _v(8, 18), ((0, ANY - _t("double")), (1, I32_64)),
                  notes="negative indices are not supported"),
    "Reshape": OpSupport(_v(8, 18), ((0, ANY), (1, _t("int64"))),
                         notes="8.x pages omit float32; it is taken from the 6.0.1 page",
                         sources=(_src("en850", "0130"), _src("zh601", "0120"), LIB_SOURCE)),
    "Transpose": _op("en850:0167", _v(8, 18), ((0, ANY - _t("double")),)),
    "Concat": _op("en850:0037", _v(8, 18), ((EVERY_INPUT, ALL_NUM),)),
    "Slice": _op("en850:0150", _v(8, 18), ((0, ANY), *((i, I32_64) for i in range(1, 5))),
                 notes="input rank must not be 1; the last axis' step must be 1"),
    "Split": _op("en850:0156", _v(8, 18), ((0, ALL_NUM), (1, _t(*_INTS[:4])))),
    "Shape": _op("en850:0143", _v(8, 18), ((0, ANY),)),
    "Unsqueeze": _op("en850:0169", _v(8, 12), ((0, ANY),)),
    "Squeeze": _op("en850:0158", _v(8, 18), ((0, ANY),)),
    "Expand": _op("zh850:0058", _v(8, 18),
                  ((0, F32 | _t("bool", "int64", "int32", "int8", "uint8")), (1, _t("int64"))),
                  notes="the shape input must be a constant"),
    "Identity": _op("zh850:0077", _v(8, 18), ((0, F32),)),
    "MatMul": _op("en850:0092", _v(8, 18), ((0, F16), (1, F16)), notes="1 to 6 dimensions"),
    "Gemm": _op("zh900:0065", _v(8, 18), ((0, F32), (1, F32)), max_inputs=2,
                notes="input C, alpha and beta are not supported"),
    "Add": _op("en850:0006", _v(8, 18), ((EVERY_INPUT, F32 | _t("double", *_INTS[:5])),)),
    "Sub": _op("en850:0159", _v(8, 15), ((EVERY_INPUT, _t("float16", "float", "int32")),)),
    "Mul": _op("dc850:0102", _v(8, 18),
               ((EVERY_INPUT, _t("float16", "float", "int8", "int32")),)),
    "Div": _op("md900:0049", _v(8, 18),
               ((EVERY_INPUT, _t("float16", "float", "double", "int32", "int64")),)),
    "Neg": _op("en850:0104", _v(8, 18), ((0, _t("int8", "float16", "float", "int32")),)),
    "Sqrt": _op("zh800:0157", _v(8, 18), ((0, F32),)),
    "Reciprocal": _op("en850:0118", _v(8, 18), ((0, F32 | _t("double")),)),
    "Pow": _op("zh800:0112", _v(8, 18), ((EVERY_INPUT, F32 | _t("double", "int32")),)),
    "ReduceMean": _op("en850:0123", _v(8, 16), ((0, F32),),
                      notes="empty axes do not reduce over every axis"),
    "ReduceSum": _op("zh800:0127", _v(8, 18), ((0, F32),)),
    "Softmax": _op("en850:0151", _v(8, 18), ((0, F32 | _t("double")),)),
    "Sigmoid": _op("en850:0145", _v(8, 18), ((0, F32),)),
    "Tanh": _op("md900:0162", _v(8, 18), ((0, F32),)),
    "ScatterND": _op("en850:0140", _v(11, 18), ((0, F32), (1, _t("int64")), (2, F32)),
                     notes="negative indices are not supported"),
    "Where": _op("en850:0170", _v(8, 18), ((0, _t("bool")), (1, _WHERE_X), (2, _WHERE_X))),
    "Cast": _op("dc800:0031", _v(8, 18),
                ((0, _t("float", "float16", "int8", "int32", "int64", "uint8", "bool")),),
                outputs=((0, _t("bool", "float16", "float", "int8", "int16", "int32")),)),
    "Equal": _op("en850:0055", _v(8, 18), ((EVERY_INPUT, ANY),)),
    "Less": _op("en850:0079", _v(8, 18), ((EVERY_INPUT, _t("float16", "float", "int32")),)),
    "Range": _op("en850:0117", _v(8, 18), ((EVERY_INPUT, F32 | I32_64),)),
    "ConstantOfShape": _op("en850:0039", _v(8, 16), ((0, _t("int64")),)),
    "Constant": _op("en850:0038", _v(8, 13), (), outputs=((0, ANY | _t("bfloat16")),)),
}


def _library_bytes(lib_path: str | os.PathLike | None) -> bytes:
    """The CANN provider library's bytes: ``lib_path``, else the one in the ``onnxruntime``
    package's capi folder (found without importing onnxruntime). Raises FileNotFoundError when
    the file is absent."""
    if lib_path is None:
        spec = importlib.util.find_spec("onnxruntime")
        dirs = list(spec.submodule_search_locations or []) if spec else []
        found = [os.path.join(d, "capi", LIBRARY) for d in dirs]
        lib_path = next((p for p in found if os.path.isfile(p)), found[0] if found else LIBRARY)
    if not os.path.isfile(lib_path):
        raise FileNotFoundError(f"{lib_path}: no CANN execution provider library")
    with open(lib_path, "rb") as f:
        return f.read()


def _elf_tables(data: bytes) -> tuple[list[tuple[int, int, int]], dict[int, int]]:
    """A 64-bit little-endian ELF file's allocated sections as (address, offset, size), and its
    relative relocations as {slot address: target address}. Raises ValueError on other files."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    machine, = struct.unpack_from("<H", data, 0x12)
    relative = {62: 8, 183: 1027}.get(machine)        # R_X86_64_RELATIVE, R_AARCH64_RELATIVE
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections, relocs = [], {}
    for i in range(shnum):
        _, kind, flags, addr, off, size, *_ = struct.unpack_from(
            "<IIQQQQIIQQ", data, shoff + i * shentsize)
        if flags & 2 and kind != 8:                    # SHF_ALLOC, not SHT_NOBITS
            sections.append((addr, off, size))
        if kind == 4:                                  # SHT_RELA
            for slot, info, addend in struct.iter_unpack("<QQq", data[off:off + size]):
                if info & 0xFFFFFFFF == relative:
                    relocs[slot] = addend
    return sections, relocs


def _read_cstr(data: bytes, sections: list[tuple[int, int, int]], addr: int) -> str | None:
    for base, off, size in sections:
        if base <= addr < base + size:
            start = addr - base + off
            return data[start:data.index(b"\0", start)].decode("ascii", "replace")
    return None


def graph_mode_ops(lib_path: str | os.PathLike | None = None) -> frozenset[str]:
    """The op types ``SupportONNXModel`` lets into CANN graph mode, read from the library.

    The names lie in ``.rodata`` from ``"Abs"`` on, but the linker merges a name that ends
    another (``Mul`` in ``MatMul``, ``Sigmoid`` in ``HardSigmoid``), so the run of strings there
    lacks 17 of them; the set's initializer is an array of relocated pointers, followed here
    from the pointer to that ``"Abs"`` up to the first name that is not an ONNX operator.

    lib_path: the library file (str or path), default the installed onnxruntime-cann's.
    Returns a frozenset of op type names. Raises FileNotFoundError when the library is absent,
    ValueError when the file is not an ELF library or holds no such table."""
    data = _library_bytes(lib_path)
    sections, relocs = _elf_tables(data)
    run = data.find(b"Abs\0Acos\0Acosh\0Add\0")
    anchor = next((base + run - off for base, off, size in sections
                   if run >= 0 and off <= run < off + size), None)
    for start, target in relocs.items():
        if target != anchor or _read_cstr(data, sections, relocs.get(start + 8, -1)) != "Acos":
            continue
        names, slot = [], start
        while (name := _read_cstr(data, sections, relocs.get(slot, -1))) is not None:
            if not (re.fullmatch(r"[A-Z][A-Za-z0-9]*", name) and onnx.defs.has(name)):
                break
            names.append(name)
            slot += 8
        return frozenset(names)
    raise ValueError("no graph-mode operator table in the library")


_KERNEL = re.compile(rb"kCannExecutionProvider_([A-Za-z0-9]+)_kOnnxDomain_ver(\d+)(?:_(\d+))?"
                     rb"(?:_([A-Za-z][A-Za-z0-9_]*?))?EEENS_16KernelCreateInfoEv")


def registered_kernels(lib_path: str | os.PathLike | None = None
                       ) -> frozenset[tuple[str, int, int | None, str]]:
    """The single-operator kernels the library registers, from their symbol names
    (``kCannExecutionProvider_Add_kOnnxDomain_ver7_12_float``).

    lib_path: as :func:`graph_mode_ops`. Returns (op type, first opset, last opset or None for
    open-ended, C++ type name such as ``"float"`` or ``"MLFloat16"``, ``""`` for a kernel
    not templated on a type) tuples. Raises FileNotFoundError when the library is absent."""
    data = _library_bytes(lib_path)
    return frozenset((m[1].decode(), int(m[2]), int(m[3]) if m[3] else None,
                      (m[4] or b"").decode()) for m in _KERNEL.finditer(data))


def _default_opset(model: onnx.ModelProto) -> int | None:
    return next((o.version for o in model.opset_import if o.domain in _DEFAULT_DOMAINS), None)


def _constant_type(node: onnx.NodeProto) -> int:
    for a in node.attribute:
        if a.name == "value":
            return a.t.data_type
        if a.name.startswith("value_"):
            return {"f": 1, "i": 7, "s": 8}.get(a.name[6], 0)   # FLOAT, INT64, STRING
    return 0


def _tensor_types(model: onnx.ModelProto) -> dict[str, str]:
    """{tensor name: element type name} from inputs, outputs, initializers, shape inference
    (which needs no external data) and Constant nodes."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except (onnx.shape_inference.InferenceError, ValueError):
        inferred = model
    g = inferred.graph
    codes = {i.name: i.data_type for i in g.initializer}
    for vi in (*g.input, *g.output, *g.value_info):
        if vi.type.HasField("tensor_type"):
            codes[vi.name] = vi.type.tensor_type.elem_type
    for node in g.node:
        if node.op_type == "Constant" and node.domain in _DEFAULT_DOMAINS and node.output:
            codes[node.output[0]] = _constant_type(node)
    return {k: onnx.TensorProto.DataType.Name(c).lower() for k, c in codes.items() if c}


def _dtype_problems(names: list[str], spec, types: dict[str, str], what: str) -> list[str]:
    problems = []
    for index, allowed in spec:
        if "float16" in allowed and what == "input":     # float32 cast: CANN_PRECISION_MODE
            allowed = allowed | {"float"}
        indices = range(len(names)) if index == EVERY_INPUT else [index]
        for i in (i for i in indices if i < len(names) and names[i]):
            dtype = types.get(names[i])
            if dtype and dtype not in allowed:
                problems.append(f"{what} {i} ({names[i]}) is {dtype}, documented: "
                                f"{', '.join(sorted(allowed))}")
    return problems


@cache
def _since_version(op_type: str, opset: int) -> int | None:
    try:
        return onnx.defs.get_schema(op_type, opset).since_version
    except onnx.defs.SchemaError:
        return None


def _node_problems(node, opset: int | None, types: dict[str, str]) -> list[str]:
    """The problems of one node (see :func:`check_model`)."""
    if node.domain not in _DEFAULT_DOMAINS:
        return [f"domain {node.domain!r} is not the default ONNX domain"]
    entry = SUPPORTED.get(node.op_type)
    if entry is None:
        return ["not among the operators checked against Ascend's pages (cann_ops.SUPPORTED)"]
    since = _since_version(node.op_type, opset) if opset is not None else None
    if opset is not None and since is None:
        return [f"not an ONNX operator at opset {opset}"]
    problems = []
    if since is not None and not entry.documents(opset, since):
        problems.append(f"opset {opset} (operator version {since}) is not among the "
                        f"documented opsets {min(entry.versions)}-{max(entry.versions)}")
    if entry.max_inputs is not None and sum(1 for n in node.input if n) > entry.max_inputs:
        problems.append(f"more inputs than the documented {entry.max_inputs}")
    problems += _dtype_problems(list(node.input), entry.inputs, types, "input")
    problems += _dtype_problems(list(node.output), entry.outputs, types, "output")
    return problems


@dataclass(frozen=True)
class KindTypes:
    """The element types one node kind (op type) of a model carries, against its page.

    Attributes:
        op_type: the operator; ``nodes``: how many of the model's nodes are of it.
        types: the element type names (``"float16"``, ``"float"``, ``"int64"``) of the inputs
            and outputs its page lists types for, over all its nodes, sorted.
        accepted: every such input and output has a type its page lists (a float32 input of
            an operator that lists float16 only counts: see ``narrowed``); False for an
            operator :data:`SUPPORTED` lacks.
        narrowed: some float32 input where the page lists float16 but not float32 (the NPU
            computes it in float16: :data:`.providers.CANN_PRECISION_MODE`).
    """

    op_type: str
    nodes: int
    types: tuple[str, ...]
    accepted: bool
    narrowed: bool


def dtype_report(model: onnx.ModelProto) -> list[KindTypes]:
    """Per node kind of ``model`` (an ``onnx.ModelProto``, external weights not needed), the
    element types its nodes carry and whether Ascend's page of the operator lists them
    (:class:`KindTypes`), in the order the kinds first appear. Tensors of unknown type are
    left out. Raises nothing."""
    types = _tensor_types(model)
    kinds: dict[str, dict] = {}
    for node in model.graph.node:
        entry = SUPPORTED.get(node.op_type) if node.domain in _DEFAULT_DOMAINS else None
        kind = kinds.setdefault(node.op_type, {"nodes": 0, "types": set(), "ok": entry is not None,
                                               "narrowed": False})
        kind["nodes"] += 1
        if entry is None:
            continue
        for names, spec, what in ((list(node.input), entry.inputs, "input"),
                                  (list(node.output), entry.outputs, "output")):
            for i, allowed in _typed(names, spec):
                dtype = types.get(names[i])
                if dtype is None:
                    continue
                kind["types"].add(dtype)
                kind["narrowed"] |= (what == "input" and dtype == "float"
                                     and "float16" in allowed and "float" not in allowed)
            kind["ok"] &= not _dtype_problems(names, spec, types, what)
    return [KindTypes(op, k["nodes"], tuple(sorted(k["types"])), k["ok"], k["narrowed"])
            for op, k in kinds.items()]


def _typed(names: list[str], spec):
    """``(index, allowed types)`` of each of ``names`` a page's ``spec`` lists types for."""
    for index, allowed in spec:
        indices = range(len(names)) if index == EVERY_INPUT else [index]
        yield from ((i, allowed) for i in indices if i < len(names) and names[i])


def check_model(model: onnx.ModelProto) -> list[str]:
    """Check a model against :data:`SUPPORTED`, :data:`ASCEND_OPSETS` and
    :data:`ASCEND_IR_VERSION`.

    model: an ``onnx.ModelProto``; external weights need not be loaded
    (``onnx.load(path, load_external_data=False)``). Returns one line per problem -- a model
    opset or IR version Ascend does not document, a node outside the default domain, an op not
    in :data:`SUPPORTED`, an op whose opset or version its page does not list, a data type its
    page does not list (float32 inputs pass where float16 is listed: the provider's
    ``precision_mode``, :data:`.providers.CANN_PRECISION_MODE`),
    more inputs than it takes -- and [] for none; tensors of unknown type are not checked.
    Raises nothing."""
    problems = []
    opset = _default_opset(model)
    lo, hi = ASCEND_OPSETS
    if opset is None or not lo <= opset <= hi:
        problems.append(f"model: default-domain opset {opset}, documented: {lo}-{hi}")
    if model.ir_version > ASCEND_IR_VERSION:
        problems.append(f"model: IR version {model.ir_version}, documented: "
                        f"<= {ASCEND_IR_VERSION} (ONNX 1.12.0)")
    types = _tensor_types(model)
    for i, node in enumerate(model.graph.node):
        where = f"node {i} {node.name or '(unnamed)'} ({node.domain or 'ai.onnx'}:{node.op_type})"
        problems += [f"{where}: {p}" for p in _node_problems(node, opset, types)]
    return problems


def _left_reason(node, opset: int, ops: frozenset[str], constants: set[str]) -> str | None:
    """Why ``SupportONNXModel`` leaves ``node`` out of graph mode, or None when it takes it."""
    if node.domain not in _DEFAULT_DOMAINS:
        return "domain"
    if opset < GRAPH_MODE_MIN_OPSET:
        return "opset"
    if node.op_type not in ops:
        return "operator"
    if all(name in constants for name in node.input):
        return "all_initializers"
    return None


def placement_in_graph_mode(model: onnx.ModelProto, ops: frozenset[str] | None = None) -> dict:
    """How many nodes CANN graph mode would take, by ``SupportONNXModel``'s rules.

    onnxruntime turns Constant nodes into initializers when it loads a model, so they are
    counted apart and their outputs count as initializers. The graph's own node order stands
    for onnxruntime's topological order, so ``partitions`` (the subgraphs
    ``enable_cann_subgraph`` would make) is an estimate.

    model: an ``onnx.ModelProto`` (weights need not be loaded). ops: the graph-mode set,
    default :func:`graph_mode_ops`. Returns a dict: ``opset``, ``nodes``, ``constant_nodes``,
    ``taken``, ``left``, ``left_by_reason`` and ``left_ops`` ({str: int}), ``partitions`` and
    ``all_taken`` (True when nothing is left out). Raises FileNotFoundError or ValueError as
    :func:`graph_mode_ops` when ``ops`` is None."""
    ops = graph_mode_ops() if ops is None else ops
    opset, g = _default_opset(model) or 0, model.graph
    constant_nodes = [n for n in g.node if n.op_type == "Constant" and n.domain in _DEFAULT_DOMAINS]
    constants = {i.name for i in g.initializer} | {o for n in constant_nodes for o in n.output}
    reasons, left_ops, taken = Counter(), Counter(), []
    for node in g.node:
        if node.op_type == "Constant" and node.domain in _DEFAULT_DOMAINS:
            continue
        reason = _left_reason(node, opset, ops, constants)
        taken.append(reason is None)
        if reason is not None:
            reasons[reason] += 1
            left_ops[f"{node.domain or 'ai.onnx'}:{node.op_type}"] += 1
    runs = sum(1 for i, t in enumerate(taken) if t and (i == 0 or not taken[i - 1]))
    return {"opset": opset, "nodes": len(taken), "constant_nodes": len(constant_nodes),
            "taken": sum(taken), "left": len(taken) - sum(taken), "left_by_reason": dict(reasons),
            "left_ops": dict(left_ops), "partitions": runs, "all_taken": all(taken)}
