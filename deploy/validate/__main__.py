"""`python3 -m deploy.validate [--kserve-schemas DIR] FILE...` (`-` reads stdin)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deploy.validate.documents import DEFAULT_KSERVE_SCHEMAS, Validator, load_documents


def main() -> int:
    parser = argparse.ArgumentParser(prog="python3 -m deploy.validate",
                                     description="Validate pagellm deployment manifests.")
    parser.add_argument("files", nargs="+", help="YAML files, or - for stdin")
    parser.add_argument("--kserve-schemas", type=Path, default=DEFAULT_KSERVE_SCHEMAS,
                        help="folder of KServe's config/crd/full/ CRD files")
    args = parser.parse_args()
    texts = [sys.stdin.read() if name == "-" else Path(name).read_text()
             for name in args.files]
    documents = load_documents(texts)
    errors = Validator(kserve_schemas=args.kserve_schemas).errors(documents)
    for error in errors:
        print(error)
    print(f"{len(documents)} documents, {len(errors)} problems", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
