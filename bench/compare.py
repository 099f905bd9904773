"""Whether two benchmark results can be compared: the fields their machines differ in.

    python bench/compare.py A.json B.json

Every bench/ JSON holds the `fingerprint` of the machine it ran on (trainyard/engine/components/fingerprint.py).
Prints `comparable: same hardware and software` or `NOT COMPARABLE:` with each differing field, and exits
with status 1 in the second case (or when a file has no fingerprint), so that a script comparing figures
across runs can refuse to.
"""
from __future__ import annotations

import json
import sys

from trainyard.engine.components.fingerprint import differences


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    prints = []
    for path in argv:
        with open(path) as fh:
            fp = json.load(fh).get("fingerprint")
        if fp is None:
            print(f"NOT COMPARABLE: {path} has no fingerprint (written before fingerprints were recorded)")
            return 1
        prints.append(fp)
    diff = differences(*prints)
    if diff:
        print("NOT COMPARABLE: the machines differ in\n  " + "\n  ".join(diff))
        return 1
    print("comparable: same hardware and software")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
