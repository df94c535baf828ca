"""A corpus of PyTorch-module-style tasks, each with its napkin kernel (issue 46, item 6).

Written for napkin, in the shape of KernelBench's first two levels (single operators, then
small fusions), not copied from it: each task is a ``torch.nn.Module`` whose ``forward`` is the
reference (run in float64), the inputs it takes, and the napkin kernel that computes the same
thing from the same tensors, the module's weights passed as the kernel's parameters.

``shapes`` are small and ragged (no tile divides them) for the runs on NumPy and OpenCL;
``realistic`` binds every axis the tuner needs at a size such a task is run at on an H100.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

F = nn.functional


@dataclass(frozen=True)
class Task:
    name: str
    module: nn.Module  # forward(*inputs) is the reference; its parameters are the kernel's weights
    napkin: str  # the kernel: parameters are the inputs, then the weights, by name
    shapes: dict  # kernel parameter (an input) -> its shape, for the runs
    realistic: dict  # axis -> size, for the tuner on H100
    sizes: dict = field(default_factory=dict)  # sizes= for axes no input carries (a pooling window)
    integers: dict = field(default_factory=dict)  # an integer input -> its exclusive upper bound
    weights: tuple = ()  # kernel parameters read off the module, by attribute, in order


class Lambda(nn.Module):
    """A task whose module has no weights: forward is the function."""

    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, *inputs):
        return self.function(*inputs)


class Layer(nn.Module):
    """A torch layer (in float64), then ``after``: the kernel takes its weight as W and its bias as bias."""

    def __init__(self, layer: nn.Module, after=None):
        super().__init__()
        self.layer = layer.double()
        self.after = after

    @property
    def W(self):
        return self.layer.weight

    @property
    def bias(self):
        return self.layer.bias

    def forward(self, X):
        Y = self.layer(X)
        return self.after(Y) if self.after is not None else Y


def Conv(conv: nn.Module, after=None) -> Layer:
    return Layer(conv, after)


def LinearTask(n_in: int, n_out: int, after=None, bias: bool = True) -> Layer:
    return Layer(nn.Linear(n_in, n_out, bias=bias), after)


class RMSNormTask(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d, dtype=torch.float64) + 0.5)

    def forward(self, X):
        return X * torch.rsqrt(X.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _grouped_weight(conv: Layer, groups: int) -> torch.Tensor:
    """torch's grouped weight [o_total c/groups ...] as the kernel's W[g o c ...]."""
    w = conv.layer.weight
    return w.reshape(groups, w.shape[0] // groups, *w.shape[1:])


def _tasks() -> list[Task]:
    torch.manual_seed(0)
    tasks = [
        # ---- level 1: single operators ------------------------------------------------------
        Task("matmul", Lambda(lambda A, B: A @ B), """kernel matmul(A: f32[m k], B: f32[k n]) -> C: f32[m n]:
    C[m n] = A * B
""", {"A": (37, 21), "B": (21, 19)}, {"m": 4096, "k": 4096, "n": 4096}),
        Task("batched matmul", Lambda(lambda A, B: torch.bmm(A, B)), """kernel bmm(A: f32[b m k], B: f32[b k n]) -> C: f32[b m n]:
    C[b m n] = A * B
""", {"A": (3, 17, 9), "B": (3, 9, 13)}, {"b": 128, "m": 512, "k": 256, "n": 512}),
        Task("matmul, B transposed", Lambda(lambda A, B: A @ B.T), """kernel mm_nt(A: f32[m k], B: f32[n k]) -> C: f32[m n]:
    C[m n] = A * B
""", {"A": (23, 11), "B": (14, 11)}, {"m": 4096, "k": 2048, "n": 4096}),
        Task("matrix-vector", Lambda(lambda A, x: A @ x), """kernel mv(A: f32[m k], x: f32[k]) -> y: f32[m]:
    y[m] = A * x
""", {"A": (41, 29), "x": (29,)}, {"m": 8192, "k": 8192}),
        Task("4D tensor times matrix", Lambda(lambda A, B: torch.einsum("bijl,lk->bijk", A, B)),
             """kernel t4(A: f32[b i j l], B: f32[l k]) -> C: f32[b i j k]:
    C[b i j k] = A * B
""", {"A": (2, 3, 5, 7), "B": (7, 6)}, {"b": 8, "i": 256, "j": 512, "l": 256, "k": 768}),
        Task("diag(a) times B", Lambda(lambda a, B: torch.diag(a) @ B), """kernel diag_mm(a: f32[i], B: f32[i j]) -> C: f32[i j]:
    C[i j] = a * B
""", {"a": (19,), "B": (19, 23)}, {"i": 4096, "j": 4096}),
        Task("relu", Lambda(torch.relu), """kernel relu_(X: f32[b d]) -> Y: f32[b d]:
    Y[b d] = relu(X)
""", {"X": (13, 37)}, {"b": 16, "d": 16384}),
        Task("gelu", Lambda(F.gelu), """kernel gelu_(X: f32[b d]) -> Y: f32[b d]:
    Y[b d] = gelu(X)
""", {"X": (13, 37)}, {"b": 16, "d": 16384}),
        Task("sigmoid", Lambda(torch.sigmoid), """kernel sigmoid_(X: f32[b d]) -> Y: f32[b d]:
    Y[b d] = sigmoid(X)
""", {"X": (13, 37)}, {"b": 16, "d": 16384}),
        Task("softplus", Lambda(F.softplus), """kernel softplus_(X: f32[b d]) -> Y: f32[b d]:
    Y[b d] = log(1 + exp(X))
""", {"X": (13, 37)}, {"b": 16, "d": 16384}),
        Task("elu", Lambda(F.elu), """kernel elu_(X: f32[b d]) -> Y: f32[b d]:
    Y[b d] = where(X > 0, X, exp(X) - 1)
""", {"X": (13, 37)}, {"b": 16, "d": 16384}),
        Task("hardtanh", Lambda(F.hardtanh), """kernel hardtanh_(X: f32[b d]) -> Y: f32[b d]:
    Y[b d] = min(max(X, -1), 1)
""", {"X": (13, 37)}, {"b": 16, "d": 16384}),
        Task("softmax", Lambda(lambda X: torch.softmax(X, -1)), """kernel softmax_(X: f32[b d]) -> Y: f32[b d]:
    Y[b d] = softmax[d](X)
""", {"X": (13, 37)}, {"b": 16, "d": 16384}),
        Task("log-softmax", Lambda(lambda X: torch.log_softmax(X, -1)), """kernel log_softmax_(X: f32[b d]) -> Y: f32[b d]:
    L[b] = lse[d](X)
    Y[b d] = X - L
""", {"X": (13, 37)}, {"b": 16, "d": 16384}),
        Task("sum over a dimension", Lambda(lambda X: X.sum(1)), """kernel sum_(X: f32[b d n]) -> Y: f32[b n]:
    Y[b n] = sum[d](X)
""", {"X": (5, 37, 11)}, {"b": 16, "d": 256, "n": 256}),
        Task("max over a dimension", Lambda(lambda X: X.amax(1)), """kernel max_(X: f32[b d n]) -> Y: f32[b n]:
    Y[b n] = max[d](X)
""", {"X": (5, 37, 11)}, {"b": 16, "d": 256, "n": 256}),
        Task("argmax over a dimension", Lambda(lambda X: X.argmax(1)), """kernel argmax_(X: f32[b i j]) -> Y: i64[b j]:
    M[b j] = max[i](X)
    Y[b j] = min[i](where(X == M, i, len(i)))
""", {"X": (5, 37, 11)}, {"b": 16, "i": 256, "j": 256}),
        Task("layer norm", Lambda(lambda X: F.layer_norm(X, X.shape[-1:], eps=1e-5)), """kernel layer_norm_(X: f32[b d]) -> Y: f32[b d]:
    mu[b] = mean[d](X)
    D[b d] = X - mu
    v[b] = mean[d](D * D)
    Y[b d] = D * rsqrt(v + 0.00001)
""", {"X": (13, 37)}, {"b": 4096, "d": 4096}),
        Task("rms norm", RMSNormTask(37), """kernel rms_norm_(X: f32[b d], weight: f32[d]) -> Y: f32[b d]:
    ms[b] = mean[d](X * X)
    Y[b d] = X * rsqrt(ms + 0.000001) * weight
""", {"X": (13, 37)}, {"b": 4096, "d": 4096}, weights=("weight",)),
        Task("instance norm", Lambda(lambda X: F.instance_norm(X, eps=1e-5)), """kernel instance_norm_(X: f32[b c h w]) -> Y: f32[b c h w]:
    mu[b c] = mean[h w](X)
    D[b c h w] = X - mu
    v[b c] = mean[h w](D * D)
    Y[b c h w] = D * rsqrt(v + 0.00001)
""", {"X": (2, 3, 7, 9)}, {"b": 16, "c": 64, "h": 128, "w": 128}),
        Task("mse loss", Lambda(F.mse_loss), """kernel mse(P: f32[b n], T: f32[b n]) -> L: f32[]:
    L[] = mean[b n]((P - T) * (P - T))
""", {"P": (13, 37), "T": (13, 37)}, {"b": 128, "n": 4096}),
        Task("cross entropy, class indices", Lambda(lambda X, T: F.cross_entropy(X, T)), """kernel ce(X: f32[b c], T: i64[b]) -> L: f32[]:
    Z[b] = lse[c](X)
    G[b] = sum[c](where(c == T, X, 0))
    L[] = mean[b](Z - G)
""", {"X": (13, 37), "T": (13,)}, {"b": 4096, "c": 4096}, integers={"T": 37}),
        Task("cosine similarity", Lambda(lambda A, B: F.cosine_similarity(A, B, dim=1, eps=0.0)), """kernel cosine(A: f32[b d], B: f32[b d]) -> Y: f32[b]:
    ab[b] = sum[d](A * B)
    aa[b] = sum[d](A * A)
    bb[b] = sum[d](B * B)
    Y[b] = ab * rsqrt(aa * bb)
""", {"A": (13, 37), "B": (13, 37)}, {"b": 128, "d": 4096}),
        Task("frobenius normalisation", Lambda(lambda X: X / torch.linalg.norm(X)), """kernel frobenius(X: f32[b n]) -> Y: f32[b n]:
    s[] = sum[b n](X * X)
    Y[b n] = X * rsqrt(s)
""", {"X": (13, 37)}, {"b": 1024, "n": 4096}),
        Task("conv1d, stride 2, padding 1, dilation 2", Conv(nn.Conv1d(3, 5, 3, stride=2, padding=1, dilation=2, bias=False)),
             """kernel conv1d_(X: f32[b c h], W: f32[o c i]) -> Y: f32[b o p]:
    Y[b o p] = pad(X[b c (2*p + 2*i - 1)], 0) * W[o c i]
""", {"X": (2, 3, 13)}, {"b": 16, "c": 64, "h": 4096, "o": 128, "i": 3}, weights=("W",)),
        Task("conv2d 3x3, padding 1", Conv(nn.Conv2d(3, 4, 3, padding=1, bias=False)),
             """kernel conv2d_(X: f32[b c h w], W: f32[o c i j]) -> Y: f32[b o p q]:
    Y[b o p q] = pad(X[b c (p + i - 1) (q + j - 1)], 0) * W[o c i j]
""", {"X": (2, 3, 7, 9)}, {"b": 32, "c": 64, "h": 56, "w": 56, "o": 64, "i": 3, "j": 3}, weights=("W",)),
        Task("conv2d 5x3, stride 2", Conv(nn.Conv2d(2, 3, (5, 3), stride=2, bias=False)),
             """kernel conv2d_s2(X: f32[b c h w], W: f32[o c i j]) -> Y: f32[b o p q]:
    Y[b o p q] = X[b c (2*p + i) (2*q + j)] * W[o c i j]
""", {"X": (2, 2, 13, 10)}, {"b": 16, "c": 3, "h": 224, "w": 224, "o": 64, "i": 5, "j": 3}, weights=("W",)),
        Task("conv2d, dilation 2", Conv(nn.Conv2d(2, 3, 3, dilation=2, padding=2, bias=False)),
             """kernel conv2d_d2(X: f32[b c h w], W: f32[o c i j]) -> Y: f32[b o p q]:
    Y[b o p q] = pad(X[b c (p + 2*i - 2) (q + 2*j - 2)], 0) * W[o c i j]
""", {"X": (2, 2, 9, 8)}, {"b": 16, "c": 64, "h": 64, "w": 64, "o": 64, "i": 3, "j": 3}, weights=("W",)),
        Task("conv3d 3x3x3", Conv(nn.Conv3d(2, 3, 3, padding=1, bias=False)),
             """kernel conv3d_(X: f32[b c t h w], W: f32[o c k i j]) -> Y: f32[b o s p q]:
    Y[b o s p q] = pad(X[b c (s + k - 1) (p + i - 1) (q + j - 1)], 0) * W[o c k i j]
""", {"X": (1, 2, 5, 6, 7)}, {"b": 8, "c": 16, "t": 16, "h": 32, "w": 32, "o": 32, "k": 3, "i": 3, "j": 3}, weights=("W",)),
        Task("depthwise conv2d", Conv(nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)),
             """kernel depthwise(X: f32[b c h w], W: f32[c i j]) -> Y: f32[b c p q]:
    Y[b c p q] = pad(X[b c (p + i - 1) (q + j - 1)], 0) * W[c i j]
""", {"X": (2, 4, 7, 9)}, {"b": 16, "c": 128, "h": 56, "w": 56, "i": 3, "j": 3}, weights=("depthwise W",)),
        Task("grouped conv2d, 2 groups", Conv(nn.Conv2d(4, 6, 3, groups=2, bias=False)),
             """kernel grouped(X: f32[b e h w], W: f32[g o c i j]) -> Y: f32[b g o p q]:
    Y[b g o p q] = X[b (len(c)*g + c) (p + i) (q + j)] * W[g o c i j]
""", {"X": (2, 4, 7, 9)}, {"b": 16, "e": 64, "g": 2, "o": 32, "c": 32, "h": 56, "w": 56, "i": 3, "j": 3},
             weights=("grouped W",)),
        Task("transposed conv1d, stride 1", Conv(nn.ConvTranspose1d(3, 4, 3, bias=False)),
             """kernel conv_t(X: f32[b c h], W: f32[c o i]) -> Y: f32[b o p]:
    Y[b o p] = pad(X[b c (p - i)], 0) * W[c o i]
""", {"X": (2, 3, 11)}, {"b": 16, "c": 64, "h": 4096, "o": 64, "i": 3}, weights=("W",)),
        Task("max pooling 2d, 3x3 stride 2 padding 1", Lambda(lambda X: F.max_pool2d(X, 3, 2, 1)),
             """kernel max_pool(X: f32[b c h w]) -> Y: f32[b c p q]:
    Y[b c p q] = max[i j](pad(X[b c (2*p + i - 1) (2*q + j - 1)], -inf))
""", {"X": (2, 3, 9, 8)}, {"b": 32, "c": 64, "h": 112, "w": 112, "i": 3, "j": 3}, sizes={"i": 3, "j": 3}),
        Task("average pooling 2d, 2x2", Lambda(lambda X: F.avg_pool2d(X, 2)),
             """kernel avg_pool(X: f32[b c h w]) -> Y: f32[b c p q]:
    Y[b c p q] = mean[i j](X[b c (2*p + i) (2*q + j)])
""", {"X": (2, 3, 9, 8)}, {"b": 32, "c": 64, "h": 112, "w": 112, "i": 2, "j": 2}, sizes={"i": 2, "j": 2}),
        Task("max pooling 1d, 4 stride 4", Lambda(lambda X: F.max_pool1d(X, 4)),
             """kernel max_pool1d(X: f32[b c h]) -> Y: f32[b c p]:
    Y[b c p] = max[i](X[b c (4*p + i)])
""", {"X": (2, 3, 19)}, {"b": 16, "c": 64, "h": 65536, "i": 4}, sizes={"i": 4}),
        Task("cumsum", Lambda(lambda X: torch.cumsum(X, 1)), """kernel cumsum_(X: f32[b x]) -> Y: f32[b x]:
    Y[b x] = cumsum[x](X)
""", {"X": (13, 37)}, {"b": 128, "x": 4000}),
        Task("cumprod", Lambda(lambda X: torch.cumprod(X, 1)), """kernel cumprod_(X: f32[b x]) -> Y: f32[b x]:
    Y[b x] = cumprod[x](X)
""", {"X": (13, 11)}, {"b": 128, "x": 4000}),
        Task("masked cumsum", Lambda(lambda X, M: torch.cumsum(X * M, 1)), """kernel masked_cumsum(X: f32[b x], M: f32[b x]) -> Y: f32[b x]:
    Y[b x] = cumsum[x](X * M)
""", {"X": (13, 37), "M": (13, 37)}, {"b": 128, "x": 4000}),
        Task("global average pooling", Lambda(lambda X: X.mean((2, 3))), """kernel gap(X: f32[b c h w]) -> Y: f32[b c]:
    Y[b c] = mean[h w](X)
""", {"X": (2, 3, 7, 9)}, {"b": 128, "c": 512, "h": 7, "w": 7}),
        # ---- level 2: small fusions ------------------------------------------------------------
        Task("linear + relu", LinearTask(11, 7, torch.relu), """kernel linear_relu(X: f32[b k], W: f32[n k], bias: f32[n]) -> Y: f32[b n]:
    Z[b n] = X * W
    Y[b n] = relu(Z + bias)
""", {"X": (13, 11)}, {"b": 1024, "k": 4096, "n": 4096}, weights=("W", "bias")),
        Task("linear + gelu + row sum", LinearTask(11, 7, lambda Y: F.gelu(Y).sum(1), bias=False),
             """kernel linear_gelu_sum(X: f32[b k], W: f32[n k]) -> S: f32[b]:
    Z[b n] = X * W
    G[b n] = gelu(Z)
    S[b] = sum[n](G)
""", {"X": (13, 11)}, {"b": 1024, "k": 4096, "n": 4096}, weights=("W",)),
        Task("conv2d + bias + relu", Conv(nn.Conv2d(3, 4, 3, padding=1), torch.relu),
             """kernel conv_relu(X: f32[b c h w], W: f32[o c i j], bias: f32[o]) -> Y: f32[b o p q]:
    Z[b o p q] = pad(X[b c (p + i - 1) (q + j - 1)], 0) * W[o c i j]
    Y[b o p q] = relu(Z + bias)
""", {"X": (2, 3, 7, 9)}, {"b": 32, "c": 64, "h": 56, "w": 56, "o": 64, "i": 3, "j": 3}, weights=("W", "bias")),
        Task("conv2d + scale + sigmoid", Conv(nn.Conv2d(3, 4, 3, bias=False), lambda Y: torch.sigmoid(Y * 0.5)),
             """kernel conv_sigmoid(X: f32[b c h w], W: f32[o c i j]) -> Y: f32[b o p q]:
    Z[b o p q] = X[b c (p + i) (q + j)] * W[o c i j]
    Y[b o p q] = sigmoid(Z * 0.5)
""", {"X": (2, 3, 7, 9)}, {"b": 32, "c": 64, "h": 56, "w": 56, "o": 64, "i": 3, "j": 3}, weights=("W",)),
        Task("conv2d + global average pooling", Conv(nn.Conv2d(3, 4, 3, bias=False), lambda Y: Y.mean((2, 3))),
             """kernel conv_gap(X: f32[b c h w], W: f32[o c i j]) -> Y: f32[b o]:
    Z[b o p q] = X[b c (p + i) (q + j)] * W[o c i j]
    Y[b o] = mean[p q](Z)
""", {"X": (2, 3, 7, 9)}, {"b": 32, "c": 64, "h": 56, "w": 56, "o": 64, "i": 3, "j": 3}, weights=("W",)),
        Task("conv2d + relu + max pooling", Conv(nn.Conv2d(3, 4, 3, padding=1, bias=False), lambda Y: F.max_pool2d(torch.relu(Y), 2)),
             """kernel conv_relu_pool(X: f32[b c h w], W: f32[o c i j]) -> Y: f32[b o s t]:
    C[b o p q] = pad(X[b c (p + i - 1) (q + j - 1)], 0) * W[o c i j]
    R[b o p q] @gmem = relu(C)
    Y[b o s t] = max[k l](R[b o (2*s + k) (2*t + l)])
""", {"X": (2, 3, 9, 7)}, {"b": 32, "c": 64, "h": 56, "w": 56, "o": 64, "i": 3, "j": 3, "k": 2, "l": 2},
             sizes={"k": 2, "l": 2}, weights=("W",)),
        Task("attention", Lambda(lambda Q, K, V: F.scaled_dot_product_attention(Q, K, V)),
             """kernel sdpa(Q: f32[b h q d], K: f32[b h x d], V: f32[b h x d]) -> O: f32[b h q d]:
    S[b h q x] = Q * K * d^-0.5
    P[b h q x] = softmax[x](S)
    O[b h q d] = P * V
""", {"Q": (1, 2, 19, 8), "K": (1, 2, 23, 8), "V": (1, 2, 23, 8)}, {"b": 4, "h": 32, "q": 4096, "x": 4096, "d": 128}),
    ]
    return tasks


TASKS = _tasks()


def weight(task: Task, name: str) -> torch.Tensor:
    """A weight the kernel takes, read off the task's module (a grouped convolution's reshaped)."""
    if name == "grouped W":
        return _grouped_weight(task.module, 2)
    if name == "depthwise W":  # torch's [c 1 i j]: one input channel a group
        return task.module.W[:, 0]
    return getattr(task.module, name)


def weight_name(name: str) -> str:
    return "W" if name in ("grouped W", "depthwise W") else name
