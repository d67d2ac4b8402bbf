"""Measuring tools, apart from the runtime core: llmrs-bench (tok/s against the machine's own
ceilings, beside llama.cpp), per-kernel timings, profile traces (code rebuilt with clock stamps),
the machine's ceilings, llmrs-check (every kernel on every back end against numpy) and plots.
They may use the compiler's codegen and every back end; the runtime core never imports them."""
