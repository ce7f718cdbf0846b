"""A recording fake of the `tensorrt` module: the subset of TensorRT 10's Python API specrt calls, checked as
TensorRT checks it, so the orchestration (network flags, profiles, builder config, contexts, shapes,
addresses, profile switches) is tested without TensorRT.

Installed with `monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt)`. Every call that matters is
appended to CALLS as a tuple. A "plan" is JSON naming the ONNX file and the profiles; an "engine" runs
that ONNX in ONNX Runtime, reading its inputs from, and writing its outputs to, the raw addresses bound
with set_tensor_address at the shapes set with set_input_shape. So a wrong address, shape, dtype or
profile gives wrong tokens or a refused step, as it would with TensorRT.

Rules kept from TensorRT's documentation: set_shape needs min <= opt <= max; set_input_shape fails
outside the context's active profile; execute fails unless every input shape and every I/O address is
set; two live contexts may not hold one profile at once (dynamic shapes); a plan from another TensorRT
version does not deserialize; ONNX TensorScatter and Attention (opset 24) import from TensorRT 10.15 on, and a
TensorScatter's output (IKVCacheUpdateLayer) must be bound to its cache input's address (in place).
"""

from __future__ import annotations

import ctypes
import enum
import json

import numpy as np

__version__ = "10.13.0"
CALLS: list[tuple] = []


def reset(version: str = "10.13.0") -> None:
    global __version__
    CALLS.clear()
    _ACTIVE_PROFILES.clear()
    __version__ = version


class ILogger:
    class Severity(enum.IntEnum):
        INTERNAL_ERROR = 0
        ERROR = 1
        WARNING = 2
        INFO = 3
        VERBOSE = 4

    def __init__(self):
        pass


class IProgressMonitor:
    def __init__(self):
        pass


class NetworkDefinitionCreationFlag(enum.IntEnum):
    EXPLICIT_BATCH = 0
    STRONGLY_TYPED = 5


class BuilderFlag(enum.IntEnum):
    FP16 = 0
    BF16 = 17
    VERSION_COMPATIBLE = 12


class MemoryPoolType(enum.IntEnum):
    WORKSPACE = 0


class HardwareCompatibilityLevel(enum.IntEnum):
    NONE = 0
    AMPERE_PLUS = 1
    SAME_COMPUTE_CAPABILITY = 2


class ExecutionContextAllocationStrategy(enum.IntEnum):
    STATIC = 0
    ON_PROFILE_CHANGE = 1
    USER_MANAGED = 2


class _Tensor:
    def __init__(self, name):
        self.name = name


class INetworkDefinition:
    def __init__(self, flags):
        self.flags = flags
        self.onnx = None
        self.inputs: list[_Tensor] = []

    @property
    def num_inputs(self):
        return len(self.inputs)

    def get_input(self, i):
        return self.inputs[i]


class OnnxParser:
    def __init__(self, network, logger):
        self.network, self.logger, self.errors = network, logger, []

    @property
    def num_errors(self):
        return len(self.errors)

    def get_error(self, i):
        return self.errors[i]

    def parse_from_file(self, path):
        import onnx

        CALLS.append(("parse_from_file", path))
        try:
            model = onnx.load(path, load_external_data=False)
        except Exception as e:  # what the parser would report
            self.errors.append(f"cannot read {path}: {e}")
            return False
        ops = {n.op_type for n in model.graph.node}
        foreign = sorted({n.op_type for n in model.graph.node if n.domain not in ("", "ai.onnx")})
        if foreign:  # ONNX Runtime's contrib ops (MatMulNBits): the parser has no importer for them
            self.errors.append(f"No importer registered for op: {foreign[0]}")
            return False
        if not _symmetric_qdq(model):
            self.errors.append("Assertion failed: TRT only supports symmetric quantization - zeroPt must be all zeros")
            return False
        version = tuple(int(p) for p in __version__.split(".")[:2])
        for op in ("TensorScatter", "Attention"):
            if op in ops and version < (10, 15):
                self.errors.append(f"No importer registered for op: {op}")
                return False
        self.network.onnx = path
        self.network.inputs = [_Tensor(i.name) for i in model.graph.input]
        return True


def _symmetric_qdq(model) -> bool:
    """Whether every QuantizeLinear / DequantizeLinear has int8 or float8 e4m3 zero points of 0 (TensorRT's explicit
    quantization is symmetric and signed)."""
    from onnx import TensorProto, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") and len(n.input) > 2 and n.input[2]:
            zero = inits[n.input[2]]
            if (zero.data_type not in (TensorProto.INT8, TensorProto.FLOAT8E4M3FN)
                    or np.asarray(numpy_helper.to_array(zero), dtype=np.float32).any()):
                return False
    return True


class IOptimizationProfile:
    def __init__(self):
        self.shapes: dict[str, tuple] = {}

    def set_shape(self, name, min, opt, max):
        min, opt, max = tuple(min), tuple(opt), tuple(max)
        if not (len(min) == len(opt) == len(max)) or not all(a <= b <= c for a, b, c in zip(min, opt, max)):
            raise ValueError(f"profile shape of {name}: need min <= opt <= max, got {min} {opt} {max}")
        self.shapes[name] = (min, opt, max)


class IBuilderConfig:
    def __init__(self):
        self.flags: set = set()
        self.pool_limits: dict = {}
        self.hardware_compatibility_level = HardwareCompatibilityLevel.NONE
        self.progress_monitor = None
        self.profiles: list[IOptimizationProfile] = []

    def set_flag(self, flag):
        self.flags.add(flag)

    def set_memory_pool_limit(self, pool, size):
        self.pool_limits[pool] = size

    def add_optimization_profile(self, profile):
        self.profiles.append(profile)
        return len(self.profiles) - 1


class Builder:
    def __init__(self, logger):
        self.logger = logger

    def create_network(self, flags=0):
        CALLS.append(("create_network", flags))
        return INetworkDefinition(flags)

    def create_builder_config(self):
        return IBuilderConfig()

    def create_optimization_profile(self):
        return IOptimizationProfile()

    def build_serialized_network(self, network, config):
        names = {t.name for t in network.inputs}
        for i, p in enumerate(config.profiles):
            if set(p.shapes) != names:
                self.logger.log(ILogger.Severity.ERROR, f"profile {i} does not set every input")
                return None
        if config.progress_monitor is not None:
            config.progress_monitor.phase_start("Building engine", None, 2)
            for step in range(2):
                config.progress_monitor.step_complete("Building engine", step)
            config.progress_monitor.phase_finish("Building engine")
        CALLS.append(("build_serialized_network", network.flags, sorted(config.flags), dict(config.pool_limits),
                      config.hardware_compatibility_level, [p.shapes for p in config.profiles]))
        plan = {"version": __version__, "onnx": network.onnx, "version_compatible": BuilderFlag.VERSION_COMPATIBLE
                in config.flags, "profiles": [{n: [list(s) for s in v] for n, v in p.shapes.items()}
                                              for p in config.profiles]}
        return json.dumps(plan).encode()


class Runtime:
    def __init__(self, logger):
        self.logger = logger
        self.engine_host_code_allowed = False

    def deserialize_cuda_engine(self, data):
        plan = json.loads(bytes(data))
        compatible = plan["version_compatible"] and self.engine_host_code_allowed
        if plan["version"] != __version__ and not compatible:
            self.logger.log(ILogger.Severity.ERROR, f"the plan was built with TensorRT {plan['version']}, "
                                                    f"this is {__version__}")
            return None
        CALLS.append(("deserialize_cuda_engine", plan["onnx"]))
        return ICudaEngine(plan, self.logger)


_ACTIVE_PROFILES: dict[tuple[int, int], int] = {}  # (engine id, profile) -> id of the context holding it


class ICudaEngine:
    def __init__(self, plan, logger):
        import onnx
        import onnxruntime

        self.logger = logger
        self.profiles = [{n: tuple(tuple(s) for s in v) for n, v in p.items()} for p in plan["profiles"]]
        self.session = onnxruntime.InferenceSession(plan["onnx"], providers=["CPUExecutionProvider"])
        model = onnx.load(plan["onnx"], load_external_data=False)
        to_np = onnx.helper.tensor_dtype_to_np_dtype
        self.dtypes = {v.name: np.dtype(to_np(v.type.tensor_type.elem_type))
                       for v in list(model.graph.input) + list(model.graph.output)}
        self.inputs = [i.name for i in model.graph.input]
        self.outputs = [o.name for o in model.graph.output]
        # IKVCacheUpdateLayer: the output shares its cache input's memory
        self.aliases = {n.output[0]: n.input[0] for n in model.graph.node
                        if n.op_type == "TensorScatter" and n.output[0] in self.outputs}

    def get_aliased_input_tensor(self, name):
        return self.aliases.get(name)

    @property
    def num_optimization_profiles(self):
        return len(self.profiles)

    @property
    def device_memory_size_v2(self):
        return 1 << 20

    def create_execution_context(self, strategy=ExecutionContextAllocationStrategy.STATIC):
        CALLS.append(("create_execution_context", strategy))
        return IExecutionContext(self)


def _array(ptr: int, dtype: np.dtype, shape) -> np.ndarray:
    """The memory at a raw address as an array (what TensorRT reads and writes there)."""
    count = int(np.prod(shape))
    buf = (ctypes.c_byte * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


class IExecutionContext:
    def __init__(self, engine):
        self.engine = engine
        self.profile = None
        self.device_memory = None
        self.shapes: dict[str, tuple] = {}
        self.addresses: dict[str, int] = {}

    def __del__(self):
        if self.profile is not None and _ACTIVE_PROFILES.get((id(self.engine), self.profile)) == id(self):
            del _ACTIVE_PROFILES[(id(self.engine), self.profile)]

    def set_device_memory(self, ptr, size):
        if size < self.engine.device_memory_size_v2:
            raise ValueError("device memory smaller than the engine needs")
        self.device_memory = (ptr, size)

    def set_optimization_profile_async(self, index, stream):
        key = (id(self.engine), index)
        if not 0 <= index < len(self.engine.profiles) or _ACTIVE_PROFILES.get(key, id(self)) != id(self):
            return False  # out of range, or held by another live context
        _ACTIVE_PROFILES[key] = id(self)
        self.profile = index
        self.shapes.clear()  # a profile switch invalidates the input shapes
        CALLS.append(("set_optimization_profile_async", id(self), index))
        return True

    def set_input_shape(self, name, shape):
        lo, _, hi = self.engine.profiles[self.profile][name]
        shape = tuple(shape)
        if len(shape) != len(lo) or not all(a <= s <= b for a, s, b in zip(lo, shape, hi)):
            return False
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name, ptr):
        self.addresses[name] = int(ptr)
        return True

    def execute_async_v3(self, stream_handle):
        e = self.engine
        if self.device_memory is None or set(self.shapes) != set(e.inputs) or \
                not set(e.inputs + e.outputs) <= set(self.addresses):
            self.engine.logger.log(ILogger.Severity.ERROR, "execute: an input shape or an I/O address is not set")
            return False
        for out, cache in e.aliases.items():
            if self.addresses[out] != self.addresses[cache]:
                self.engine.logger.log(ILogger.Severity.ERROR, f"execute: {out} must be bound to {cache}'s address")
                return False
        feeds = {n: _array(self.addresses[n], e.dtypes[n], self.shapes[n]).copy() for n in e.inputs}
        CALLS.append(("execute_async_v3", id(self), self.profile, {n: self.shapes[n] for n in e.inputs[:3]}))
        for name, value in zip(e.outputs, e.session.run(e.outputs, feeds)):
            _array(self.addresses[name], e.dtypes[name], value.shape)[...] = value
        return True
