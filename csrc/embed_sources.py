"""Writes the C++ file that embeds kernel sources into the extension.

    python csrc/embed_sources.py {cuda,ascend} TEMPLATE OUTPUT

The kernels compiled at run time (CUDA by NVRTC, Ascend by clang or bisheng)
travel inside the extension as {name, text} pairs, so what compiles is always
what the package was built with. This file is the one list of what each set
holds: CMakeLists.txt and bazel/csrc.BUILD both run it, and tests/test_build.py
asks it what the loaded extension must hold. It replaces
``@FASTATTN_EMBEDDED_SOURCES@`` in TEMPLATE with the pairs, sorted by name.
"""

from __future__ import annotations

import glob
import os
import sys

#: The folder this file is in (csrc/); patterns and names are relative to it.
CSRC = os.path.dirname(os.path.abspath(__file__))

#: Each set: the files it holds (glob patterns) and the folder its names are
#: relative to (None: the file name, as NVRTC's #include sees the headers).
SETS = {
    "cuda": (("kernels/cuda/*.cu", "kernels/cuda/*.cuh", "kernels/attention_*.h"), None),
    "ascend": (("kernels/ascend/*.cpp", "kernels/ascend/*.h", "kernels/ascend/sim/*",
                "kernels/attention_dtypes.h", "kernels/attention_rules.h"), "kernels"),
}

_DELIMITER = "fastattn_src"


def sources(name: str, root: str = CSRC) -> dict[str, str]:
  """The set ``name`` ('cuda' or 'ascend') under ``root``: {name: text}, sorted.

  Raises:
    ValueError: two files of the set share a name, or a file contains the raw
      string's delimiter.
  """
  patterns, base = SETS[name]
  out = {}
  for pattern in patterns:
    for path in glob.glob(os.path.join(root, pattern)):
      key = os.path.basename(path) if base is None else os.path.relpath(
          path, os.path.join(root, base))
      with open(path, encoding="utf-8") as f:
        text = f.read()
      if key in out:
        raise ValueError(f"two {name} kernel sources are named {key}")
      if f"){_DELIMITER}\"" in text:
        raise ValueError(f"{path} contains the embedding delimiter ){_DELIMITER}\"")
      out[key] = text
  return dict(sorted(out.items()))


def main(argv: list[str]) -> int:
  if len(argv) != 3 or argv[0] not in SETS:
    print(f"usage: embed_sources.py {{{','.join(SETS)}}} TEMPLATE OUTPUT", file=sys.stderr)
    return 2
  name, template, output = argv
  pairs = "".join(f'    {{"{key}", R"{_DELIMITER}({text}){_DELIMITER}"}},\n'
                  for key, text in sources(name).items())
  with open(template, encoding="utf-8") as f:
    text = f.read().replace("@FASTATTN_EMBEDDED_SOURCES@", pairs)
  with open(output, "w", encoding="utf-8") as f:
    f.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
