"""A recording fake of `triton_python_backend_utils`, the module Triton's Python backend gives a model.py: the
subset serving/triton_model.py uses, so its decode loop is tested without Triton (which does not install here)."""

from __future__ import annotations

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, array

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class TritonError:
    def __init__(self, message):
        self._message = message

    def message(self):
        return self._message


class InferenceResponse:
    def __init__(self, output_tensors=None, error=None):
        self.output_tensors, self.error = output_tensors or [], error


class ResponseSender:
    def __init__(self):
        self.sent: list[tuple[InferenceResponse | None, int]] = []

    def send(self, response=None, flags=0):
        if self.sent and self.sent[-1][1] & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            raise RuntimeError("a response was sent after the final flag")
        self.sent.append((response, flags))


class InferenceRequest:
    def __init__(self, **inputs):
        self.inputs = {name: Tensor(name, value) for name, value in inputs.items()}
        self.sender = ResponseSender()

    def get_response_sender(self):
        return self.sender


def get_input_tensor_by_name(request, name):
    return request.inputs.get(name)
