"""scripts/kernelbench.py end to end on small settings: its results file holds a row per shape,
type and M for the kernels, and with ``--model`` a row per M for whole decode steps of the real
default model (the step's time, its ratio to one sequence; no product-only fields)."""

from __future__ import annotations

import json

from gguf_blocks import built_kernels
from script_modules import load_script

kernelbench = load_script("kernelbench")


def test_products_and_whole_decode_steps_in_one_results_file(tmp_path, model_path):
    built_kernels()
    out = tmp_path / "kernelbench.json"
    assert kernelbench.main(["--types", "Q4_0", "--rows", "1,3", "--rounds", "1", "--calls",
                             "1", "--model", model_path, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["kind"] == "kernelbench" and doc["isa"] and doc["model"] == model_path
    rows = doc["results"]
    products = [r for r in rows if r["type"] == "Q4_0"]
    assert sorted((r["N"], r["K"], r["M"]) for r in products) == sorted(
        (n, k, m) for n, k in kernelbench.SHAPES for m in (1, 3))
    assert all(r["op_ms"] > 0 and r["mlas_ms"] > 0 and r["vs_mlas"] > 0 for r in products)
    steps = {r["M"]: r for r in rows if r["type"] == "step"}
    assert sorted(steps) == [1, 3] and steps[1]["vs_m1"] == 1.0
    for r in steps.values():
        assert r["N"] is r["K"] is r["ctypes_ms"] is r["mlas_ms"] is r["vs_mlas"] is None
        assert r["op_ms"] > 0
        assert abs(r["vs_m1"] - r["op_ms"] / steps[1]["op_ms"]) < 2e-3 * r["vs_m1"]
