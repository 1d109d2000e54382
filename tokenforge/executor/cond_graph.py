"""If-nodes in torch-captured CUDA graphs: captured work that a replay runs only while a device
flag is set, with no host read in between.

In: the CUDAGraph being captured, a one-element device flag (bool, uint8 or int32) and the
capture's memory pool. `if_node(...)` is a context manager: the work issued inside it is captured
into the node's body. Out: nothing; the graph holds the node.

Two builders, the first found is used:
- torch's own (`CUDAGraph.begin_capture_to_if_node`, torch 2.12 and later);
- cuda-python (`cuda.bindings`, in CUDA's images; the device image's torch 2.11 lacks the first):
  on the stream being captured, a conditional handle is made on the graph under capture, a
  one-thread kernel (NVRTC, compiled once a context) copies the flag into it, and an if-node
  joins the capture. Its body graph is then captured from a side stream whose allocations go to
  the capture's pool (from the first node on, every allocation of the capturing thread does),
  and the capture goes on after the node.
`builder()` names the one in use (None: neither; the caller keeps its graph without the nodes).
"""

from __future__ import annotations

import contextlib
import ctypes

import torch

TORCH, CUDA_PYTHON = "torch", "cuda-python"

# The device side of the handle API, declared as CUDA's runtime header declares it (NVRTC resolves
# the builtin), and the two flag widths the callers use.
_SOURCE = r"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                      unsigned int value);
extern "C" __global__ void tf_if_from_byte(cudaGraphConditionalHandle handle, const unsigned char* flag) {
    cudaGraphSetConditional(handle, flag[0] != 0);
}
extern "C" __global__ void tf_if_from_int(cudaGraphConditionalHandle handle, const int* flag) {
    cudaGraphSetConditional(handle, flag[0] != 0);
}
"""
_KERNELS: dict[int, dict[int, object]] = {}      # context -> flag width -> CUfunction
_SIDE: dict[int, torch.cuda.ExternalStream] = {}  # device -> the stream the bodies are captured from


def _cuda_python():
    try:
        from cuda.bindings import driver, nvrtc, runtime
    except ImportError:
        return None
    return driver, nvrtc, runtime


def builder() -> str | None:
    """Which builder `if_node` uses here: TORCH, CUDA_PYTHON, or None (no CUDA, or neither)."""
    if not torch.cuda.is_available():
        return None
    if hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        return TORCH
    if _cuda_python() is not None and hasattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool"):
        return CUDA_PYTHON
    return None


@contextlib.contextmanager
def if_node(graph: torch.cuda.CUDAGraph, flag: torch.Tensor, pool, use: str | None = None):
    """Capture the work issued inside as the body of an if-node on `flag` (read on the device when
    the replay reaches the node). `pool`: the pool the capture was given (`torch.cuda.graph(...,
    pool=)`). `use`: force a builder (tests); RuntimeError when none applies."""
    use = use or builder()
    if flag.numel() != 1 or flag.device.type != "cuda" or flag.element_size() not in (1, 4):
        raise RuntimeError(f"if_node: the flag must be one bool/uint8/int32 element on CUDA, not {flag.dtype} "
                           f"{tuple(flag.shape)} on {flag.device}")
    if use == TORCH:
        graph.begin_capture_to_if_node(flag)
        try:
            yield
        finally:
            graph.end_capture_to_conditional_node()
    elif use == CUDA_PYTHON:
        with _cuda_python_if(flag, pool):
            yield
    else:
        raise RuntimeError("if_node: this torch cannot capture conditional nodes and cuda-python (cuda.bindings) "
                           "is not installed")


def _check(result, what: str):
    """cuda-python returns (error, *values): the values, or RuntimeError naming the call."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"if_node: {what} failed: {err}")
    return values


def _kernel(driver, nvrtc, width: int):
    """The flag-to-handle kernel for this context and flag width, compiled on first use."""
    (ctx,) = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    cached = _KERNELS.setdefault(int(ctx), {})
    if width not in cached:
        major, minor = torch.cuda.get_device_capability()
        (prog,) = _check(nvrtc.nvrtcCreateProgram(_SOURCE.encode(), b"tf_if_node.cu", 0, [], []), "nvrtcCreateProgram")
        opts = [f"--gpu-architecture=compute_{major}{minor}".encode()]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(err) != 0:
            (size,) = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = bytearray(size)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"if_node: NVRTC could not compile the flag kernel: {bytes(log).decode(errors='replace')}")
        (size,) = _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        ptx = bytearray(size)
        _check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        (module,) = _check(driver.cuModuleLoadData(bytes(ptx)), "cuModuleLoadData")
        for w, name in ((1, b"tf_if_from_byte"), (4, b"tf_if_from_int")):
            (cached[w],) = _check(driver.cuModuleGetFunction(module, name), "cuModuleGetFunction")
    return cached[width]


def _capture_info(runtime, stream: int):
    """(graph under capture, its current dependencies) of a capturing stream."""
    status, _id, graph, deps, *_ = _check(runtime.cudaStreamGetCaptureInfo(stream), "cudaStreamGetCaptureInfo")
    if status != runtime.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive:
        raise RuntimeError("if_node: the current stream is not capturing a CUDA graph")
    return graph, list(deps)


def _with_edge_data(call, *args):
    """cuda-python 13's form (edge data after the dependencies), else 12's."""
    try:
        return call(*args[:2], None, *args[2:])
    except TypeError:
        return call(*args)


@contextlib.contextmanager
def _cuda_python_if(flag: torch.Tensor, pool):
    if pool is None:
        raise RuntimeError("if_node: the cuda-python builder needs the capture's pool (torch.cuda.graph(pool=...))")
    driver, nvrtc, runtime = _cuda_python()
    device = flag.device.index if flag.device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(device).cuda_stream
    graph, _ = _capture_info(runtime, stream)
    (handle,) = _check(runtime.cudaGraphConditionalHandleCreate(graph, 0, 0), "cudaGraphConditionalHandleCreate")
    fn = _kernel(driver, nvrtc, flag.element_size())
    args = ((int(handle), flag.data_ptr()), (ctypes.c_ulonglong, ctypes.c_void_p))
    _check(driver.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, args, 0), "cuLaunchKernel")
    graph, deps = _capture_info(runtime, stream)
    params = driver.CUgraphNodeParams()
    params.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    params.conditional.handle = handle
    params.conditional.type = driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF
    params.conditional.size = 1
    (params.conditional.ctx,) = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    (node,) = _check(_with_edge_data(driver.cuGraphAddNode, graph, deps, len(deps), params), "cuGraphAddNode")
    body = params.conditional.phGraph_out[0]
    _check(_with_edge_data(runtime.cudaStreamUpdateCaptureDependencies, stream, [node], 1,
                           runtime.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies),
           "cudaStreamUpdateCaptureDependencies")
    side = _side_stream(runtime, device)
    _check(runtime.cudaStreamBeginCaptureToGraph(side.cuda_stream, body, None, None, 0,
                                                 runtime.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
           "cudaStreamBeginCaptureToGraph")
    _route_this_thread(device, pool)
    try:
        with torch.cuda.stream(side):
            yield
    finally:
        _check(runtime.cudaStreamEndCapture(side.cuda_stream), "cudaStreamEndCapture")


def _side_stream(runtime, device: int) -> torch.cuda.ExternalStream:
    """A stream of our own for the bodies' captures (one at a time), made once a device: torch's
    pooled streams come round again after 32, and one of them is the stream being captured."""
    if device not in _SIDE:
        (raw,) = _check(runtime.cudaStreamCreateWithFlags(runtime.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
        _SIDE[device] = torch.cuda.ExternalStream(int(raw), device=device)
    return _SIDE[device]


def _route_this_thread(device: int, pool) -> None:
    """Send every allocation this thread makes to the capture's pool, the body's side stream too:
    torch routes the capture's allocations by its capture id, which the body's capture does not
    share, and a pool takes one routing at a time. So the capture's routing is swapped for this
    thread's until the capture ends (torch's capture_end removes it; the graph is captured from
    this thread alone), and the pool's extra reference from the swap is given back."""
    torch._C._cuda_endAllocateToPool(device, pool)
    torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if release is not None:
        release(device, pool)
