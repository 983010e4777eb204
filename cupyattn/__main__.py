"""usage: python -m cupyattn {check,options} ...

commands:
  check     compile every kernel instantiation for each GPU family with NVRTC (no GPU needed)
            and report registers, shared memory, spills and code size; `check --sass`: the
            Hopper kernels' machine code (loops, waits; needs nvdisasm); `python -m cupyattn check --help`
  options   print the table of options by kernel path (docs/options.md) as markdown
"""
import sys

USAGE = __doc__.splitlines()[0]


def main(argv=None) -> int:
    """argparse's convention: help on stdout with status 0; no command or an unknown one is a
    usage error, on stderr with status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.rstrip())
        return 0
    if not argv:
        print(f"{USAGE}\npython -m cupyattn: error: a command is required (check, options)", file=sys.stderr)
        return 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "check":
        from ._compile_check import main as check_main

        return check_main(rest)
    if cmd == "options":
        if rest:
            print(f"{USAGE}\npython -m cupyattn options: error: takes no arguments, got {' '.join(rest)}",
                  file=sys.stderr)
            return 2
        from .options import markdown

        sys.stdout.write(markdown())
        return 0
    print(f"{USAGE}\npython -m cupyattn: error: unknown command {cmd!r} (choose check, options)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
