"""Attention written in Python with the @napkin.kernel decorator.

Run it:  python examples/attention.py
"""

import napkin_dsl as napkin


@napkin.kernel(hardware="H100", relabel="smem: group b 1, h 1, q 128; stream x 64")
def attention(
    Q: napkin.bf16["b h q d"], K: napkin.bf16["b h x d"], V: napkin.bf16["b h x d"]
) -> napkin.bf16["b h q d"]:
    """
    S[b h q x] = Q * K * d^-0.5
    P[b h q x] = softmax[x](S)
    O[b h q d] = P * V
    """


if __name__ == "__main__":
    print(attention)
    for statement in attention.diagram.statements:
        print(f"  {statement.target}: woven over {' '.join(statement.woven)}; consumes {' '.join(statement.consumed) or '-'}")
