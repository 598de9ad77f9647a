"""Codegen: schedule + spec → CUDA C++ (Jinja, templates/) → NVRTC sm_90a cubin (cached)."""

from mkc.codegen.build import KernelArtifact, build_kernel, write_kernel
from mkc.codegen.nvrtc import CompileError
from mkc.codegen.render import CodegenError, CodegenOptions

__all__ = ["CodegenError", "CodegenOptions", "CompileError", "KernelArtifact", "build_kernel", "write_kernel"]
