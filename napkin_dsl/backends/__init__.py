"""Backends: the ways a napkin Program is run or compiled.

``numpy`` interprets the pseudocode on any machine; ``cuda`` prints CUDA C++ and compiles it
with ``nvrtc`` (source to cubin, with a cache) and launches it through ``driver`` (a checked
layer over the CUDA driver API); ``opencl`` prints OpenCL C. Importing this package imports
none of them, so nothing here needs cuda-python or a GPU until it is used.
"""
