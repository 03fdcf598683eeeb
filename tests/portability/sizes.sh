#!/usr/bin/env bash
# The sizes STYLE.md asks of the core folders' C++: functions of at most about a screen
# (FUNCTION_LINES, 80 by default) and files of at most FILE_LINES (600) lines, tests and
# benchmarks aside. Prints every function and file over its bound, longest first, and the
# counts. A function is counted from the first line of its signature at the start of a line
# to its closing brace at the start of a line (the codebase's layout: definitions in a
# namespace are not indented), so members defined inside a class body are not counted.
#   sizes.sh [SOURCE_DIR]   (exit 1 when anything is over its bound)
set -euo pipefail
cd "${1:-$(dirname "${BASH_SOURCE[0]}")/../..}"
/usr/bin/python3 - "${FUNCTION_LINES:-80}" "${FILE_LINES:-600}" <<'EOF'
import glob, sys
fn_bound, file_bound = int(sys.argv[1]), int(sys.argv[2])
folders = ["common", "model", "shmem", "kernels", "worker", "server", "app", "client", "tools"]
files = sorted(f for d in folders for pat in ("*.h", "*.cc", "detail/*.h", "detail/*.cc")
               for f in glob.glob(f"{d}/{pat}"))
skip = ("//", "#", "namespace", "}", "class ", "struct ", "enum ", "using ", "extern ", "union ")
long_files, long_fns = [], []
for path in files:
    lines = open(path, encoding="utf-8").read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) > file_bound:
        long_files.append((len(lines), path))
    start = None      # first line of a signature at column 0
    body = None       # the line its body opened on
    for i, line in enumerate(lines):
        if body is None:
            if line and not line[0].isspace() and not line.startswith(skip):
                if start is None:
                    start = i
                if line.rstrip().endswith("{"):
                    body = i
                elif line.rstrip().endswith(";"):
                    start = None
            elif not line.strip() or line.startswith(("//", "#", "}")):
                start = None
            elif start is not None and line.rstrip().endswith("{"):
                body = i
        else:
            if line.rstrip() == "}":
                n = i - start + 1
                if n > fn_bound:
                    sig = " ".join(l.strip() for l in lines[start:body + 1])
                    name = sig.split("(")[0].split()[-1] if "(" in sig else sig[:60]
                    long_fns.append((n, f"{path}:{start + 1}", name))
                start = body = None
            elif line.rstrip() == "};":  # an initializer or a class body, not a function
                start = body = None
for n, path in sorted(long_files, reverse=True):
    print(f"file {path}: {n} lines (bound {file_bound})")
for n, where, name in sorted(long_fns, reverse=True):
    print(f"function {name} at {where}: {n} lines (bound {fn_bound})")
print(f"sizes: {len(files)} files; {len(long_files)} over {file_bound} lines, "
      f"{len(long_fns)} functions over {fn_bound} lines")
sys.exit(1 if long_files or long_fns else 0)
EOF
