"""Plan.open: validation of every bad-plan case, mapped weights, the verified-weights cache,
and llmrs-inspect."""
import json
import os
import zlib
from pathlib import Path

import numpy as np
import pytest

from llmrs.compiler.plan import ALIGN, FORMAT_VERSION, HEADER, HEADER_CRC_AT, write_graph_plan
from llmrs.models.llama import build_graphs, load_model
from llmrs.runtime import inspect as inspect_cli
from llmrs.runtime import plan as plan_mod
from llmrs.runtime.plan import Plan, PlanError

from ..conftest import DATA

OPENCL = "__kernel void add(__global float* a) { a[get_global_id(0)] += 1.0f; }\n" * 4


def make_plan(path: Path, name: str = "golden-a", layout: bool = False) -> Path:
    """A small real plan: both graphs of a golden model, an OpenCL and a tokenizer section."""
    model = load_model(DATA / name)
    prefill, decode = build_graphs(model, prefill_T=4, max_seq_len=16)
    if layout:
        for g in (prefill, decode):
            arena, off = {}, 0
            for v in g.values.values():
                if v.kind in ("act", "input") and v.alias is None:
                    arena[v.name], off = off, off + -(-v.nbytes // 64) * 64
            kv, kv_off = {}, 0
            for s in g.state:
                kv[s], kv_off = kv_off, kv_off + -(-g.values[s].nbytes // 64) * 64
            g.meta["layout"] = {"alignment": 64, "arena_bytes": off, "arena": arena, "kv_bytes": kv_off,
                                "kv": kv, "naive_bytes": off, "lower_bound_bytes": off // 4}
    tokenizer = (DATA / name / "tokenizer.json").read_text()
    manifest = {"compile_command": "llmrs-compile m -o p.bin", "model": model.config.to_json(),
                "prefill_chunk": 4, "max_seq_len": 16}
    write_graph_plan(path, {"prefill": prefill, "decode": decode}, manifest,
                     {"opencl": OPENCL, "tokenizer.json": tokenizer})
    return path


def header_fields(raw: bytes) -> list:
    return list(HEADER.unpack(raw[:HEADER.size]))


def restamp(raw: bytes, **changes: int) -> bytes:
    """raw with header fields changed and the header checksum made valid again."""
    names = ["magic", "version", "header_bytes", "file_bytes", "manifest_offset", "manifest_bytes",
             "manifest_crc32", "reserved", "crc"]
    f = dict(zip(names, header_fields(raw)))
    f.update(changes)
    head = HEADER.pack(*[f[n] for n in names])[:HEADER_CRC_AT]
    return head + zlib.crc32(head).to_bytes(4, "little") + raw[HEADER.size:]


def manifest_of(raw: bytes) -> dict:
    f = header_fields(raw)
    return json.loads(raw[f[4]:f[4] + f[5]])


def with_manifest(raw: bytes, change) -> bytes:
    """raw with its manifest edited by change(manifest) and stored, validly checksummed, at the
    end of the file (the old one zeroed), so only the edit itself can make the plan bad."""
    f = header_fields(raw)
    m_off, m_size = f[4], f[5]
    manifest = manifest_of(raw)
    change(manifest)
    text = json.dumps(manifest).encode()
    body = bytearray(raw)
    body[m_off:m_off + m_size] = bytes(m_size)
    body += bytes(-len(body) % ALIGN)
    new_off = len(body)
    body += text
    return restamp(bytes(body), file_bytes=len(body), manifest_offset=new_off, manifest_bytes=len(text),
                   manifest_crc32=zlib.crc32(text))


def flip(raw: bytes, at: int) -> bytes:
    b = bytearray(raw)
    b[at] ^= 0x5A
    return bytes(b)


def refused(path: Path, match: str, verify: str = "auto") -> str:
    with pytest.raises(PlanError, match=match) as e:
        Plan.open(path, verify=verify).check_weights()   # damaged weights: refused at first use
    msg = str(e.value)
    assert msg.startswith(str(path)) and "\n" not in msg
    return msg


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMRS_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def plan_path(tmp_path) -> Path:
    return make_plan(tmp_path / "p.bin")


def test_weights_are_memmap_views_with_the_model_bytes(plan_path):
    plan = Plan.open(plan_path)
    model = load_model(DATA / "golden-a")
    for name, ref in model.tensors.items():
        got = plan.weight(name)
        assert isinstance(got, np.memmap) and not got.flags.writeable
        np.testing.assert_array_equal(got, ref.load())
    region = plan.weights_region()
    assert isinstance(region, np.memmap) and region.dtype == np.uint8
    t = plan.tensors["model.norm.weight"]
    assert region[t.offset:t.offset + t.nbytes].tobytes() == plan.weight("model.norm.weight").tobytes()
    opencl = plan.section("opencl")
    assert isinstance(opencl, memoryview) and opencl.readonly and bytes(opencl).decode() == OPENCL
    for g in plan.graphs().values():
        assert np.shares_memory(g.weights["model.norm.weight"].load(), region)


def test_missing_tensor_and_section_are_named(plan_path):
    plan = Plan.open(plan_path)
    with pytest.raises(PlanError, match="no tensor 'lm_head.weight'"):
        plan.weight("lm_head.weight")
    with pytest.raises(PlanError, match=r"no section 'llvm.aarch64-linux-android' .*opencl"):
        plan.section("llvm.aarch64-linux-android")


@pytest.mark.parametrize("where", ["empty", "in magic", "in header", "in manifest", "in opencl", "in weights",
                                   "last byte"])
def test_truncated_plan_is_refused(plan_path, where):
    raw = plan_path.read_bytes()
    m = manifest_of(raw)
    cut = {"empty": 0, "in magic": 5, "in header": 40, "in manifest": HEADER.size + 100,
           "in opencl": m["sections"]["opencl"]["offset"] + 10,
           "in weights": m["sections"]["weights"]["offset"] + 1000, "last byte": len(raw) - 1}[where]
    plan_path.write_bytes(raw[:cut])
    refused(plan_path, "empty file" if cut == 0 else "truncated")


@pytest.mark.parametrize("section", ["opencl", "tokenizer.json", "weights"])
def test_flipped_byte_in_a_section_names_it(plan_path, section):
    raw = plan_path.read_bytes()
    s = manifest_of(raw)["sections"][section]
    plan_path.write_bytes(flip(raw, s["offset"] + s["size"] // 2))
    refused(plan_path, f"section '{section}' is corrupted")


@pytest.mark.parametrize("at, match", [(8, "header is corrupted"), (30, "header is corrupted"),
                                       (50, "header is corrupted"), (63, "header is corrupted"),
                                       (HEADER.size + 7, "manifest is corrupted")])
def test_flipped_byte_in_header_or_manifest_is_refused(plan_path, at, match):
    plan_path.write_bytes(flip(plan_path.read_bytes(), at))
    refused(plan_path, match)


def test_flipped_byte_in_padding_is_refused(plan_path):
    raw = plan_path.read_bytes()
    s = manifest_of(raw)["sections"]["opencl"]
    end = s["offset"] + s["size"]
    assert end % ALIGN and raw[end] == 0
    plan_path.write_bytes(flip(raw, end))
    refused(plan_path, "padding .* is not zero")


@pytest.mark.parametrize("content", [
    b"", b"\x89PNG\r\n\x1a\n" + bytes(100), b"hello world, not a plan at all\n" * 10,
    (DATA / "golden-a" / "model.safetensors").read_bytes()])
def test_foreign_file_is_refused(tmp_path, content):
    path = tmp_path / "foreign.bin"
    path.write_bytes(content)
    refused(path, "empty file" if not content else "not an llmrs plan")


def test_newer_format_version_asks_to_recompile_or_upgrade(plan_path):
    plan_path.write_bytes(restamp(plan_path.read_bytes(), version=FORMAT_VERSION + 1))
    msg = refused(plan_path, "newer")
    assert msg == (f"{plan_path}: plan format v{FORMAT_VERSION + 1} is newer than this llmrs "
                   f"(v{FORMAT_VERSION}); recompile or upgrade")


def test_trailing_bytes_are_refused(plan_path):
    plan_path.write_bytes(plan_path.read_bytes() + b"\x00" * 64)
    refused(plan_path, "unexpected bytes after")


def _set(path: list, value):
    def change(m):
        d = m
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return change


ABSURD = {
    "tensor offset far past the file": (_set(["tensors", "model.norm.weight", "offset"], 1 << 62),
                                        "'model.norm.weight'"),
    "tensor of 2^80 bytes": (_set(["tensors", "model.norm.weight", "shape"], [1 << 40, 1 << 40]),
                             "'model.norm.weight'"),
    "tensor nbytes disagrees with shape": (_set(["tensors", "model.norm.weight", "nbytes"], 4), "'model.norm.weight'"),
    "negative tensor offset": (_set(["tensors", "model.norm.weight", "offset"], -64), "'model.norm.weight'"),
    "misaligned tensor": (_set(["tensors", "model.norm.weight", "offset"], 8), "'model.norm.weight'"),
    "tensor dtype unknown": (_set(["tensors", "model.norm.weight", "dtype"], "f8"), "'model.norm.weight'"),
    "tensor shape not ints": (_set(["tensors", "model.norm.weight", "shape"], ["64"]), "'model.norm.weight'"),
    "overlapping tensors": (_set(["tensors", "model.norm.weight", "offset"], 0), "overlaps tensor"),
    "section of 2^63 bytes": (_set(["sections", "opencl", "size"], 1 << 63), "section 'opencl'"),
    "section offset misaligned": (_set(["sections", "opencl", "offset"], 65), "section 'opencl'"),
    "section offset a float": (_set(["sections", "opencl", "offset"], 64.0), "section 'opencl'"),
    "section checksum not hex": (_set(["sections", "opencl", "crc32"], "zzzzzzzz"), "section 'opencl'"),
    "sections overlap": (_set(["sections", "opencl", "size"], 1 << 20), "section 'opencl'"),
    "no weights section": (lambda m: m["sections"].pop("weights"), "'weights' section"),
    "no tensor table": (lambda m: m.pop("tensors"), "no tensor table"),
    "graph uses a missing tensor": (lambda m: m["tensors"].pop("model.norm.weight"),
                                    "graph 'prefill' is malformed.*'model.norm.weight'"),
    "graph value shape wrong": (lambda m: m["graphs"]["decode"]["values"][0].__setitem__(1, [7]),
                                "graph 'decode' is malformed"),
    "graph op unknown": (lambda m: m["graphs"]["decode"]["ops"][0].__setitem__("kind", "conv"),
                         "graph 'decode' is malformed.*unknown kind"),
    "graph T absurd": (_set(["graphs", "prefill", "T"], -1), "graph 'prefill' is malformed"),
    "graphs not an object": (_set(["graphs"], [1, 2]), "'graphs' is not an object"),
}


@pytest.mark.parametrize("case", sorted(ABSURD))
def test_absurd_manifest_is_refused(plan_path, case):
    change, match = ABSURD[case]
    plan_path.write_bytes(with_manifest(plan_path.read_bytes(), change))
    refused(plan_path, match)


def test_rewritten_manifest_alone_is_accepted(plan_path):
    """The absurd-manifest cases above differ from a good plan only by their edit."""
    plan_path.write_bytes(with_manifest(plan_path.read_bytes(), lambda m: None))
    assert set(Plan.open(plan_path).graphs()) == {"prefill", "decode"}


def test_manifest_that_is_not_json_is_refused(plan_path):
    raw = plan_path.read_bytes()
    f = header_fields(raw)
    text = b"{not json" + b" " * (f[5] - 9)
    body = raw[:f[4]] + text + raw[f[4] + f[5]:]
    plan_path.write_bytes(restamp(body, manifest_crc32=zlib.crc32(text)))
    refused(plan_path, "not valid UTF-8 JSON")


def _damage_weights_in_place(path: Path, at: int = 5) -> None:
    """Change weight bytes inside the file (same inode, same size) and put its mtime back."""
    st = path.stat()
    w = manifest_of(path.read_bytes())["sections"]["weights"]
    with open(path, "r+b") as f:
        f.seek(w["offset"] + at)
        old = f.read(4)
        f.seek(w["offset"] + at)
        f.write(bytes(b ^ 0x5A for b in old))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size


def test_weights_changed_in_place_with_the_mtime_restored_are_refused(plan_path):
    """The defect: a cache keyed on (path, inode, size, mtime) let such a file run unchecked."""
    assert Plan.open(plan_path).weight("model.norm.weight").sum() != 0   # a first, good open
    _damage_weights_in_place(plan_path)
    plan = Plan.open(plan_path)        # the structure is fine: open returns, the check runs behind it
    for use in (lambda: plan.weight("model.norm.weight"), plan.weights_region, lambda: plan.verification,
                lambda: plan.graphs()["decode"].weights["model.norm.weight"].load()):
        with pytest.raises(PlanError, match="section 'weights' is corrupted") as e:
            use()
        assert str(e.value).startswith(str(plan_path)) and "\n" not in str(e.value)
    refused(plan_path, "section 'weights' is corrupted", verify="always")


def test_every_open_checks_the_weights_before_handing_one_out(plan_path, monkeypatch):
    seen = []
    real = plan_mod.WeightsCheck._run

    def spy(self):
        seen.append(len(self._region))
        real(self)

    monkeypatch.setattr(plan_mod.WeightsCheck, "_run", spy)
    size = manifest_of(plan_path.read_bytes())["sections"]["weights"]["size"]
    for _ in range(3):
        plan = Plan.open(plan_path)
        np.testing.assert_array_equal(plan.weight("model.norm.weight"), load_model(DATA / "golden-a").tensors[
            "model.norm.weight"].load())
        assert plan.verification == "checked"
    assert seen == [size] * 3
    assert Plan.open(plan_path, verify="never").verification == "skipped" and seen == [size] * 3


def test_corrupted_weights_pass_only_with_verify_never(plan_path):
    raw = plan_path.read_bytes()
    w = manifest_of(raw)["sections"]["weights"]
    plan_path.write_bytes(flip(raw, w["offset"] + 5))
    assert Plan.open(plan_path, verify="never").verification == "skipped"
    refused(plan_path, "section 'weights' is corrupted", verify="always")
    with pytest.raises(PlanError, match="section 'weights' is corrupted"):
        Plan.open(plan_path).weights_region()


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_weights_damaged_in_place_are_one_line_from_llmrs_run(tmp_path, capsys, backend):
    from llmrs.compiler.cli import main as compile_main
    from llmrs.runtime.cli import main as run_main

    plan_path = tmp_path / "run.plan.bin"
    assert compile_main([str(DATA / "golden-a"), "-o", str(plan_path), "--target", "cpu", "--weights", "f32",
                         "--max-seq-len", "16", "--prefill-chunk", "4", "-q"]) == 0
    argv = [str(plan_path), "--prompt", "hi", "-n", "2", "--backend", backend]
    assert run_main(argv) == 0        # the first run: a metadata cache would have remembered the file here
    _damage_weights_in_place(plan_path, at=1000)
    capsys.readouterr()
    assert run_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("llmrs-run: error:") and "section 'weights' is corrupted" in err


def test_unknown_verify_mode_is_refused(plan_path):
    refused(plan_path, "verify='sometimes'", verify="sometimes")


def test_missing_file_is_a_plan_error(tmp_path):
    refused(tmp_path / "nope.bin", "cannot read the plan")
    refused(tmp_path, "cannot read the plan")


def test_inspect_prints_model_sections_kernels_and_arena(tmp_path, capsys):
    path = make_plan(tmp_path / "p.bin", "golden-b", layout=True)
    assert inspect_cli.main([str(path)]) == 0
    out = capsys.readouterr().out
    plan = Plan.open(path)
    for want in ("llmrs-compile m -o p.bin", "num_hidden_layers          2", "bf16", "opencl", "tokenizer.json",
                 f"{plan.graphs()['decode'].kernel_count()} kernels", "arena decode", "kv prefill",
                 "lower_bound_bytes"):
        assert want in out, want
    layout = plan.graphs()["decode"].meta["layout"]
    rows = [line.split() for line in out.split("arena decode")[1].split("kv decode")[0].splitlines()[1:]]
    assert [int(r[0]) for r in rows] == sorted(layout["arena"].values())
    assert rows[-1][-1] == "logits" and f"({layout['arena_bytes']} bytes)" in out


def test_inspect_bad_plan_is_one_line_and_exit_code_2(plan_path, capsys):
    plan_path.write_bytes(plan_path.read_bytes()[:1000])
    assert inspect_cli.main([str(plan_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "truncated" in err and "Traceback" not in err
    assert err.startswith("llmrs-inspect: error:")


def test_inspect_on_a_folder_or_a_bad_flag_is_one_line_and_exit_code_2(tmp_path, capsys):
    assert inspect_cli.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"llmrs-inspect: error: {tmp_path}: cannot read the plan")
    with pytest.raises(SystemExit) as e:
        inspect_cli.main([str(tmp_path), "--verify", "sometimes"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "invalid choice: 'sometimes'" in err
