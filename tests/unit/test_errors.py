"""One exception tree: every public exception class capsteer defines derives from
CapsteerError, and the server turns any of them into the status its class means."""

from __future__ import annotations

import importlib
import inspect
import json

from capsteer.capture.spec import SpecError
from capsteer.capture.writer.budget import Overloaded
from capsteer.config.errors import CapsteerError
from capsteer.server.errors import exception_body, from_exception
from capsteer.steering.registry import VectorNameError, VectorNotFoundError

from .house import product_modules

# Exceptions used as control flow inside one module, never raised to a caller.
PRIVATE_OK = {"AlreadyPublished"}


def test_every_public_exception_class_derives_from_capsteer_error():
    loose = []
    for name in product_modules():
        module = importlib.import_module(name)
        for cls_name, cls in vars(module).items():
            if (inspect.isclass(cls) and issubclass(cls, BaseException)
                    and cls.__module__ == name and not cls_name.startswith("_")
                    and cls_name not in PRIVATE_OK and not issubclass(cls, CapsteerError)):
                loose.append(f"{name}.{cls_name}")
    assert not loose, f"exceptions outside the CapsteerError tree: {loose}"


def test_the_server_maps_each_error_to_its_status_and_field():
    status, body = exception_body(SpecError("capture.layers", "layer 9 is out of range"))
    error = json.loads(body)["error"]
    assert (status, error["param"], error["type"]) == (400, "capture.layers", "BadRequestError")
    assert from_exception(VectorNotFoundError("x"), "name").status_code == 404
    assert from_exception(VectorNameError("bad name"), "name").status_code == 400
    response = from_exception(Overloaded("budget in use"), "capture")
    assert response.status_code == 429
    assert json.loads(response.body)["error"]["type"] == "RateLimitError"
    # builtin bases stay, so callers that caught them still do
    assert isinstance(SpecError("f", "r"), ValueError)
    assert isinstance(VectorNotFoundError("x"), KeyError)
