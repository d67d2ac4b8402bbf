"""Code-generation targets for the CPU back end: triple, CPU name, features, and what they allow.

Host detection goes through LLVM; cross targets (aarch64 under qemu, Android phones) name their CPU
and features explicitly, because LLVM's host detection under qemu says `generic`. Emitting object
code for a foreign target runs in a child process, so a feature set LLVM aborts on is an error
here, not a dead compiler.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass

import llvmlite.binding as llvm

from ...child import python_argv


class TargetError(ValueError):
    """A target LLVM cannot generate code for; the message names the triple and what to change."""


@dataclass(frozen=True)
class Target:
    triple: str          # e.g. x86_64-unknown-linux-gnu, aarch64-linux-gnu, aarch64-linux-android
    cpu: str = "generic"
    features: str = ""   # LLVM feature string: "+avx2,+fma" / "+neon,+dotprod"

    @property
    def arch(self) -> str:
        return self.triple.split("-")[0]

    def has(self, feature: str) -> bool:
        return f"+{feature}" in self.features.split(",")

    @property
    def is_x86(self) -> bool:
        return self.arch in ("x86_64", "amd64")

    @property
    def is_aarch64(self) -> bool:
        return self.arch in ("aarch64", "arm64")

    @property
    def int8_dot(self) -> str:
        """How a 32-value int8 block dot product is computed: vnni | avx2 | sdot | generic."""
        if self.is_x86 and (self.has("avxvnni") or (self.has("avx512vnni") and self.has("avx512vl"))):
            return "vnni"
        if self.is_x86 and self.has("avx2"):
            return "avx2"
        if self.is_aarch64 and self.has("dotprod"):
            return "sdot"
        return "generic"

    @property
    def int8_matmul(self) -> bool:
        """aarch64 with i8mm: smmla multiplies 2 x 8 by 8 x 2 int8 tiles (prefill's row and token
        pairs; llvm_matmul.tile)."""
        return self.is_aarch64 and self.has("i8mm")

    @property
    def float_lanes(self) -> int:
        """f32 lanes of the vectors kernels use (256-bit on AVX2+, 128-bit NEON/SSE otherwise)."""
        return 8 if self.is_x86 and self.has("avx2") else 4

    def key(self) -> str:
        """The plan section suffix for object code of this target."""
        return self.triple


_initialized = False


def init_llvm() -> None:
    global _initialized  # LLVM's own target registry is process-wide; initialise it once
    if not _initialized:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        llvm.initialize_all_targets()
        llvm.initialize_all_asmprinters()
        _initialized = True


def host_target() -> Target:
    """The machine we run on, with every feature LLVM detects."""
    init_llvm()
    feats = llvm.get_host_cpu_features().flatten()
    return Target(llvm.get_process_triple(), llvm.get_host_cpu_name(), feats)


def aarch64_target(dotprod: bool, triple: str = "aarch64-unknown-linux-gnu", i8mm: bool = False) -> Target:
    """A generic ARMv8.2 core (Cortex-A55/A76 class) with or without the int8 dot product, and
    with i8mm (ARMv8.6 smmla: Cortex-A510/A710/X2 and later) on top where asked."""
    return Target(triple, "generic", "+neon,+fp-armv8" + (",+dotprod" if dotprod else "") + (",+i8mm" if i8mm else ""))


def parse_target(spec: str) -> Target:
    """`host` or `TRIPLE[:CPU[:FEATURES]]`, as given on a command line."""
    if spec in ("", "host"):
        return host_target()
    parts = spec.split(":")
    if len(parts) > 3:
        raise TargetError(f"--triple {spec!r}: expected TRIPLE[:CPU[:FEATURES]]")
    triple = parts[0]
    cpu = parts[1] if len(parts) > 1 and parts[1] else "generic"
    feats = parts[2] if len(parts) > 2 else ("+neon,+fp-armv8" if triple.startswith("aarch64") else "")
    return Target(triple, cpu, feats)


def target_machine(target: Target, opt: int = 3) -> llvm.TargetMachine:
    init_llvm()
    try:
        t = llvm.Target.from_triple(target.triple)
    except RuntimeError as e:
        raise TargetError(f"target {target.triple!r}: LLVM has no back end for it ({e}); "
                          "use x86_64-* or aarch64-*") from None
    # PIC so the object can be loaded anywhere (RuntimeDyld, or linked into a shared driver)
    return t.create_target_machine(cpu=target.cpu, features=target.features, opt=opt,
                                   reloc="pic", codemodel="default")


def optimize(module: llvm.ModuleRef, target: Target) -> None:
    tm = target_machine(target)
    pto = llvm.create_pipeline_tuning_options(speed_level=3)
    pto.loop_vectorization = True
    pto.slp_vectorization = True
    pto.loop_unrolling = True
    pb = llvm.create_pass_builder(tm, pto)
    pm = pb.getModulePassManager()
    pm.run(module, pb)


def _emit_in_process(ir_text: str, triple: str, cpu: str, features: str, kind: str) -> bytes:
    target = Target(triple, cpu, features)
    mod = llvm.parse_assembly(ir_text)
    mod.triple = triple
    mod.verify()
    optimize(mod, target)
    tm = target_machine(target)
    if kind == "asm":
        return tm.emit_assembly(mod).encode()
    return tm.emit_object(mod)


def emit(ir_text: str, target: Target, kind: str = "obj") -> bytes:
    """Optimised object code (or assembly) for target, generated in a child process: LLVM aborts
    the whole process on some bad cpu/feature combinations."""
    code = ("from llmrs.compiler.codegen.llvm_target import _emit_in_process as e, init_llvm;"
            "init_llvm(); a = sys.argv[1:]; sys.stdout.buffer.write(e(sys.stdin.read(), *a))")
    proc = subprocess.run(python_argv(code, target.triple, target.cpu, target.features, kind),
                          input=ir_text.encode(), capture_output=True)
    if proc.returncode != 0:
        last = (proc.stderr.decode(errors="replace").strip().splitlines() or ["(no message)"])[-1]
        raise TargetError(f"LLVM failed to generate code for {target.triple} cpu={target.cpu} "
                          f"features={target.features or '(none)'}: {last}; check --triple")
    return proc.stdout
