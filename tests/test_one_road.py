"""One road to the GPU (issue 45, item 1): ``kernel(..., backend="cuda")`` runs what
``Kernel.compile()`` builds, planned and tuned on the profile of the GPU it runs on, and a repeated
call plans, selects, lowers, prices and encodes nothing.

Without a GPU, the driver is replaced at its one boundary: the device (``backends.cuda._device``:
memory, the module's load and the launch) and the tensor-map encode (``driver.encode_tiled``). The
code, its compile through NVRTC and everything above them run as they do on a GPU."""

from __future__ import annotations

import cProfile
import pstats

import ml_dtypes
import numpy as np
import pytest

import napkin_dsl as napkin
from napkin_dsl.backends import cuda, driver
from napkin_dsl.errors import NapkinError
from napkin_dsl.hardware import profile_for_device

from .conftest import EXAMPLES


@pytest.mark.parametrize("name, profile", [("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 PCIe", "H100"),
                                           ("NVIDIA H200", "H200"), ("NVIDIA A100-SXM4-80GB", "A100"),
                                           ("NVIDIA L40S", "L40S")])
def test_the_driver_name_of_a_gpu_maps_to_its_profile(name, profile):
    assert profile_for_device(name) == profile


def test_a_gpu_without_a_profile_is_named_with_the_profiles_and_how_to_add_one():
    with pytest.raises(NapkinError, match=r"no hardware profile for the GPU 'NVIDIA GeForce RTX 4090' \(its profiles: A100, H100, H200, L40S\)") as error:
        profile_for_device("NVIDIA GeForce RTX 4090")
    assert "Adding a GPU" in error.value.hint


class DeviceArray:
    """A device array as a caller's CUDA tensor presents it (``__cuda_array_interface__``)."""

    def __init__(self, address: int, shape: tuple, typestr: str):
        self.__cuda_array_interface__ = {"data": (address, False), "shape": shape, "typestr": typestr,
                                         "strides": None, "version": 3}


class RecordingDevice:
    """The driver's device, recorded instead of run: what is loaded and launched."""

    name, arch = "NVIDIA H100 80GB HBM3", "sm_90"

    def __init__(self):
        self.images, self.launches, self.next_address = [], [], 1 << 20

    def load(self, image):
        self.images.append(image)
        return len(self.images)

    def function(self, module, entry):
        return entry

    def launch(self, function, grid, block, args, shared_bytes=0, stream=None):
        self.launches.append((function, grid, block, shared_bytes, len(args)))

    def alloc(self, nbytes):
        self.next_address += max(nbytes, 256)
        return self.next_address

    def to_device(self, array):
        return self.alloc(array.nbytes)

    def copy_to_host(self, buffer, host):
        return host

    def synchronize(self, stream=None):
        pass

    def free(self, buffer):
        pass


@pytest.fixture
def gpu(monkeypatch):
    pytest.importorskip("cuda.bindings")  # NVRTC compiles the code as on a GPU
    device = RecordingDevice()
    encoded = []

    def encode(tensor_map, address):
        encoded.append((tensor_map, address))
        return bytes(128)

    monkeypatch.setattr(cuda, "current_device", lambda: device)
    monkeypatch.setattr(driver, "encode_tiled", encode)
    monkeypatch.setattr(cuda, "_modules", {})
    monkeypatch.setattr(cuda, "_maps", {})
    return device, encoded


SIZES = dict(m=1024, n=1024, k=1024)


def _matmul():
    """matmul as a user writes it first: no relabel block."""
    return napkin.load((EXAMPLES / "matmul.napkin").read_text().split("relabel")[0])["matmul"]


def test_a_call_on_the_gpu_runs_what_compile_builds(gpu):
    device, encoded = gpu
    kernel = _matmul()
    a = np.zeros((SIZES["m"], SIZES["k"]), ml_dtypes.bfloat16)
    b = np.zeros((SIZES["k"], SIZES["n"]), ml_dtypes.bfloat16)
    out = kernel(a, b, backend="cuda")
    assert out.shape == (SIZES["m"], SIZES["n"]) and out.dtype == np.float32
    compiled = kernel.compile(**SIZES)  # the profile's own arch, as a call on an H100 picks it
    assert device.images == [compiled.image]
    assert compiled.arch == "sm_90a" and compiled.launches[0].path == "wgmma"  # tuned on H100, not the FMA path
    assert [launch[:4] for launch in device.launches] == [(k.entry, k.grid, k.block, k.shared_bytes) for k in compiled.launches]
    # A and B by TMA: a tensor map each, encoded over the device buffer the call made of each
    assert len(encoded) == len(compiled.selection[0].plan.tma) == 2


def test_a_repeated_call_plans_selects_lowers_prices_and_encodes_nothing(gpu):
    device, encoded = gpu
    kernel = _matmul()
    a = DeviceArray(1 << 40, (SIZES["m"], SIZES["k"]), "<V2")  # a caller's CUDA tensors, read in place
    b = DeviceArray(2 << 40, (SIZES["k"], SIZES["n"]), "<V2")
    kernel(a, b, backend="cuda", cast=False)
    first = len(encoded)
    ran = _profiled(lambda: kernel(a, b, backend="cuda"))
    assert not ran & (STAGES | {("cuda.py", "compile_program"), ("cuda.py", "tensor_map_arguments")}), ran & STAGES
    assert len(encoded) == first and len(device.images) == 1 and len(device.launches) == 2


def _profiled(call) -> set[tuple[str, str]]:
    """(module file, function) of every napkin function ``call()`` runs."""
    profile = cProfile.Profile()
    profile.enable()
    call()
    profile.disable()
    return {(path.rsplit("/", 1)[-1], name) for (path, _, name), entry in pstats.Stats(profile).stats.items()
            if entry[1] and "napkin_dsl" in path}


STAGES = {("syntax.py", "parse"), ("kernel.py", "load"), ("plan.py", "plan"), ("tune.py", "tune"),
          ("isel.py", "select_program"), ("translate.py", "lower"), ("cost.py", "cost_of"), ("pseudocode.py", "elaborate")}


def test_a_repeated_call_on_numpy_plans_selects_and_prices_nothing():
    # its own copy of the text: a kernel no other test has called, so that its first call plans
    (kernel,) = napkin.load((EXAMPLES / "attention.napkin").read_text() + "# test_one_road\n").values()
    q = np.zeros((1, 2, 16, 8), ml_dtypes.bfloat16)
    first = _profiled(lambda: kernel(q, q, q))
    assert ("isel.py", "select_program") in first or ("plan.py", "plan") in first  # so that "not in" below can fail
    assert not _profiled(lambda: kernel(q, q, q)) & STAGES


def test_the_launch_description_carries_its_tensor_maps_through_the_disk_cache(tmp_path, monkeypatch):
    """What the printer decided reaches the launcher as the compiled launch itself: its tensor
    maps are the ones the Program's selection gives, and they survive the disk cache."""
    pytest.importorskip("cuda.bindings")
    from napkin_dsl.backends.compiled import read_compiled, write_compiled

    compiled = _matmul().compile(**SIZES)
    (launch,) = compiled.launches
    assert sorted(name for name, _ in launch.tensor_maps) == ["A", "B"]
    assert list(launch.tensor_maps) == cuda.tensor_map_arguments(compiled.program, compiled.selection)[0]
    monkeypatch.setenv("NAPKIN_CACHE_DIR", str(tmp_path))
    write_compiled("k", compiled)
    assert list(tmp_path.rglob("k.json"))
    (again,) = read_compiled("k", lambda: pytest.fail("reading the launches planned the kernel")).launches
    assert again == launch
