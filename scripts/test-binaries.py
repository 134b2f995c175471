#!/usr/bin/env python3
"""Copy the test binaries of cargo's JSON messages (standard input, from `cargo test --no-run
--message-format=json`) into the folder named by the first argument: one per tests/*.rs under
its name, the library's unit tests as <crate>-unit."""
import json
import os
import shutil
import sys

dest = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        name = m["target"]["name"] + ("-unit" if m["target"]["kind"] == ["lib"] else "")
        shutil.copy(m["executable"], os.path.join(dest, name))
        print("bundled test", name)
