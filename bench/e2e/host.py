"""What the end-to-end benchmarks print about the machine they ran on."""

import os


def cpu_model_and_flags():
    """(model name, set of flags) of the first CPU in /proc/cpuinfo."""
    model = "unknown CPU"
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags


def host_description():
    """"<CPU model>, <N> hardware threads, <vector extensions>" from /proc/cpuinfo."""
    model, flags = cpu_model_and_flags()
    isa = [x for x in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if x in flags]
    return f"{model}, {os.cpu_count()} hardware threads, {' '.join(isa) or 'no AVX2'}"
