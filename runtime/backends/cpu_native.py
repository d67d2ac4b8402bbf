"""Load CPU kernels into this process: a plan's object code for the host, or its LLVM IR, JIT-compiled."""
from __future__ import annotations

import llvmlite.binding as llvm


class NativeCodeError(RuntimeError):
    """Object code or IR that cannot run on this machine; the message says what to do."""


def host_triple() -> str:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    return llvm.get_process_triple()


def _host_machine() -> llvm.TargetMachine:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    target = llvm.Target.from_triple(llvm.get_process_triple())
    return target.create_target_machine(cpu=llvm.get_host_cpu_name(),
                                        features=llvm.get_host_cpu_features().flatten(), opt=3)


class NativeCode:
    """An MCJIT engine holding either a prebuilt object or a JIT-compiled module; keep it alive
    as long as any function address taken from it is called."""

    def __init__(self, ir_text: str | None = None, obj: bytes | None = None):
        if (ir_text is None) == (obj is None):
            raise NativeCodeError("NativeCode takes exactly one of LLVM IR text or object bytes")
        tm = _host_machine()
        if ir_text is not None:
            mod = llvm.parse_assembly(ir_text)
            mod.triple = llvm.get_process_triple()
            mod.verify()
            pto = llvm.create_pipeline_tuning_options(speed_level=3)
            pb = llvm.create_pass_builder(tm, pto)
            pb.getModulePassManager().run(mod, pb)
        else:
            mod = llvm.parse_assembly("")
            mod.triple = llvm.get_process_triple()
        self._engine = llvm.create_mcjit_compiler(mod, tm)
        if obj is not None:
            self._engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
        self._engine.finalize_object()

    def address(self, name: str) -> int:
        addr = self._engine.get_function_address(name)
        if not addr:
            raise NativeCodeError(f"native code has no function {name!r}; recompile the plan")
        return addr
