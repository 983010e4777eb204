"""`python -m cupyattn check [--json] [--only SPEC]`: offline compile check (no GPU needed).
`python -m cupyattn options`: the table of options by kernel path (docs/options.md), as markdown."""
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "check":
        from ._compile_check import main as check_main

        return check_main(rest)
    if cmd == "options":
        from .options import markdown

        sys.stdout.write(markdown())
        return 0
    print(f"unknown command {cmd!r}; try: python -m cupyattn check | options", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
