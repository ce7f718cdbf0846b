"""specrt's decode loop as a Triton Inference Server Python-backend model (`specrt triton` copies this file to
<repo>/specrt/1/model.py).

Decoupled: a request gets one response per text piece as rounds are accepted, then an empty final flag.

    inputs   PROMPT (string, [1]); optional MAX_NEW_TOKENS (int32), METHOD (string), TEMPERATURE (fp32),
             SEED (int64), each [1]
    outputs  TEXT (string, [1]): the next piece of the continuation

The model's parameters (config.pbtxt) say which bundle to load, with which backend, device and threads, and
the method a request that names none gets. The Python environment Triton runs this in must have specrt
installed (pip, or the Python backend's EXECUTION_ENV_PATH). Each instance serves its requests one after
another; `instance_group.count` serves several at once.
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

INPUTS = {"MAX_NEW_TOKENS": ("max_new_tokens", int), "METHOD": ("method", str), "TEMPERATURE": ("temperature", float),
          "SEED": ("seed", int)}


def _value(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    value = tensor.as_numpy().reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value


class TritonPythonModel:
    def initialize(self, args):
        from specrt.runtime.pipeline import Pipeline

        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.method = params.get("method") or "sd"
        threads = int(params["threads"]) if params.get("threads") else None
        self.pipe = Pipeline.load(params["bundle"], backend=params.get("backend") or "ort", threads=threads,
                                  device=params.get("device") or None)

    def execute(self, requests):
        from specrt.errors import SpecrtError

        for request in requests:
            sender = request.get_response_sender()
            try:
                prompt = _value(request, "PROMPT")
                if prompt is None:
                    raise SpecrtError("the request has no PROMPT")
                kwargs = {"method": self.method}
                for name, (key, kind) in INPUTS.items():
                    value = _value(request, name)
                    if value is not None:
                        kwargs[key] = kind(value)
                for piece in self.pipe.stream(prompt, **kwargs):
                    text = np.array([piece.encode("utf-8")], dtype=np.object_)
                    sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("TEXT", text)]))
            except (SpecrtError, ValueError, TypeError) as e:  # the request's fault: say so to its client
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self):
        self.pipe = None
