#!/usr/bin/env python3
"""Find the machine code in Vulkan pipeline-cache blobs and disassemble it (diagnosis only).

`wgsl_bench kernel_statistics` with ATTNKIT_STATS_DIR=dir writes one `.vkcache` file a kernel
(vkGetPipelineCacheData, the driver's own format). This script looks in each for ELF images
(NVIDIA's compiled kernels are cubins), also inside zlib/zstd streams, writes them next to the
blob and runs `nvdisasm` (else `cuobjdump -sass`) on each; it prints a summary of the SASS
(instruction counts by opcode) so that kernels can be compared without reading the listings.

    python3 scripts/vkcache_sass.py DIR
"""
import collections
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib


def elf_images(data):
    out = []
    i = data.find(b"\x7fELF")
    while i >= 0:
        try:
            if data[i + 4] == 2:  # 64-bit
                shoff, = struct.unpack_from("<Q", data, i + 0x28)
                phoff, = struct.unpack_from("<Q", data, i + 0x20)
                phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, i + 0x36)
                end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
                for s in range(shnum):
                    o = i + shoff + s * shentsize
                    off, size = struct.unpack_from("<QQ", data, o + 0x18)
                    typ, = struct.unpack_from("<I", data, o + 4)
                    if typ != 8:  # not NOBITS
                        end = max(end, off + size)
                if 0 < end < len(data) - i + 1:
                    out.append(data[i:i + end])
        except struct.error:
            pass
        i = data.find(b"\x7fELF", i + 4)
    return out


def streams(data):
    yield "raw", data
    for m in re.finditer(b"\x78[\x01\x5e\x9c\xda]", data):
        try:
            d = zlib.decompressobj().decompress(data[m.start():])
            if len(d) > 256:
                yield f"zlib@{m.start()}", d
        except zlib.error:
            pass
    try:
        import zstandard
        for m in re.finditer(b"\x28\xb5\x2f\xfd", data):
            try:
                d = zstandard.ZstdDecompressor().decompressobj().decompress(data[m.start():])
                yield f"zstd@{m.start()}", d
            except zstandard.ZstdError:
                pass
    except ImportError:
        pass


def summary(text):
    ops = collections.Counter()
    for line in text.splitlines():
        m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?", line)
        if m and "/*0" in line:
            ops[m.group(1) + (m.group(2) or "")] += 1
    return ops


def main():
    d = sys.argv[1]
    tool = shutil.which("nvdisasm")
    for f in sorted(os.listdir(d)):
        if not f.endswith(".vkcache"):
            continue
        data = open(os.path.join(d, f), "rb").read()
        print(f"== {f}: {len(data)} bytes, head {data[:48].hex()}")
        n = 0
        for src, blob in streams(data):
            for img in elf_images(blob):
                n += 1
                cub = os.path.join(d, f"{f[:-8]}.{n}.cubin")
                open(cub, "wb").write(img)
                cmd = [tool, "-c", cub] if tool else ["cuobjdump", "-sass", cub]
                r = subprocess.run(cmd, capture_output=True, text=True)
                sass = cub + ".sass"
                open(sass, "w").write(r.stdout + r.stderr)
                ops = summary(r.stdout)
                print(f"  ELF {n} from {src}: {len(img)} bytes, {sum(ops.values())} instructions -> {os.path.basename(sass)}")
                print("   ", ", ".join(f"{k} {v}" for k, v in ops.most_common(40)))
                if not ops:
                    print("   ", (r.stdout + r.stderr)[:400].replace("\n", " | "))
        if n == 0:
            print("  no ELF image found")


if __name__ == "__main__":
    main()
