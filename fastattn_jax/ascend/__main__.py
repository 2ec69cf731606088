"""``python -m fastattn_jax.ascend fetch|check``: the Ascend toolchain."""

import argparse
import subprocess
import sys

from fastattn_jax import ascend


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m fastattn_jax.ascend", description=(
      "Ascend toolchain: `fetch` downloads the PTO-ISA headers into the kernel cache; "
      "`check` says which Ascend paths can run here and why not."))
  parser.add_argument("command", choices=("fetch", "check"))
  args = parser.parse_args(argv)
  if args.command == "fetch":
    try:
      print(ascend.fetch_pto())
    except (RuntimeError, subprocess.CalledProcessError) as err:
      print(f"python -m fastattn_jax.ascend fetch: {err}", file=sys.stderr)
      return 1
    return 0
  for name in ascend.IMPLEMENTATIONS:
    print(f"{name}: {ascend.unavailable(name) or 'available'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
