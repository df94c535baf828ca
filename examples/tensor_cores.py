"""What napkin builds for attention and a GEMM on tensor cores, and what its model says about it.

Run it (no GPU needed: NVRTC compiles on the CPU):  python examples/tensor_cores.py

For each kernel it prints the instruction path instruction selection chose for every statement
(the warp tiles, what lives in registers, the cp.async pipeline), the pseudocode's register
level, the compiled kernel's registers and shared memory, the model's bound, and, where the
nvdisasm wheel is installed (pip install 'napkin-dsl[sass]'), the hot loop's SASS mix.
It builds for sm_90, the mma.sync path; the H100 profile's own arch, sm_90a, takes wgmma and TMA
where instruction selection can (set ARCH below to "sm_90a" to see it).
Try a relabelling: add `registers: group m 32, n 64` to MATMUL below and run it again.
"""

import napkin_dsl as napkin
from napkin_dsl.backends import sass

ATTENTION = """
kernel attention(Q: bf16[b h q d], K: bf16[b h x d], V: bf16[b h x d]) -> O: bf16[b h q d]:
    S[b h q x] = Q * K * d^-0.5
    P[b h q x] = softmax[x](S)
    O[b h q d] = P * V

relabel attention on H100:
    smem: group b 1, h 1, q 128; stream x 64
"""

MATMUL = """
kernel matmul(A: bf16[m k], B: bf16[k n]) -> C: f32[m n]:
    C[m n] = A * B

relabel matmul on H100:
    smem: group m 128, n 128; stream k 32
"""


ARCH = "sm_90"
attention = napkin.load(ATTENTION)["attention"]
matmul = napkin.load(MATMUL)["matmul"]


def show(kernel, sizes: dict) -> None:
    compiled = kernel.compile(ARCH, **sizes)
    print(f"== {kernel.name} at {' '.join(f'{k}={v}' for k, v in sizes.items())}")
    for row in compiled.launch_table():
        print(f"  {row['entry']}: {row['path']}, {row['registers']} registers, {row['shared_bytes']:,} B shared, "
              f"{row['block'][0]} threads, {row['spill_bytes']} B spilled")
        for line in row["statements"]:
            print(f"    {line}")
    warps = [line.strip() for line in kernel.pseudocode(arch=ARCH, **sizes).splitlines() if "@registers" in line]
    print(f"  pseudocode: {warps[0] if warps else 'no register level (FMA path)'}")
    time = compiled.cost.time
    print(f"  model: {time['overlapped_s'] * 1e3:.3f} ms, {time['bound']}-bound, "
          f"{time['blocks_per_sm']} block(s) per SM ({time['occupancy_bound']})")
    try:
        report = sass.sass_report(compiled)
    except sass.NoDisassembler as missing:
        print(f"  SASS: not shown ({missing.hint})")
        return
    for entry in report["launches"]:
        loop = sass.hot_loop(entry)
        if loop is None:
            continue
        classes = loop["classes"]
        print(f"  SASS hot loop: {loop['instructions']} instructions, {classes.get('tensor', 0)} HMMA, "
              f"{classes.get('ldsm', 0)} LDSM, {classes.get('ldgsts', 0)} LDGSTS, "
              f"{loop['per_tensor']} per HMMA")


if __name__ == "__main__":
    show(attention, dict(b=4, h=32, q=8192, x=8192, d=128))
    show(matmul, dict(m=8192, n=8192, k=8192))
