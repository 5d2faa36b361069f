"""A DLPack producer for one uint32 word at a raw CUDA device pointer, so JAX can view it without a
copy (``jax.dlpack.from_dlpack(PointerTensor(ptr, device_id))``): the fused path's flag page
(`bridge.host_flag`) is host memory mapped into the device's address space, which no array library
owns. The capsule's deleter does nothing: the pointer's owner releases the memory, and must keep it
(and this object) alive while a consumer views it.

Moved out of `bridge.host_flag`.
"""
from __future__ import annotations

import ctypes

__all__ = ["PointerTensor"]


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]
_NO_DELETE = _DELETER(lambda _p: None)  # the page's owner (SharedFlag) releases it, not the consumer
_CAPSULE_NAME = b"dltensor"
_KDLCUDA, _KDLUINT = 2, 1


class PointerTensor:
    """``__dlpack__`` for one uint32 word at a device pointer (kept alive by its owner)."""

    def __init__(self, ptr: int, device_id: int):
        self._shape = (ctypes.c_int64 * 1)(1)
        self._mt = _DLManagedTensor()
        self._mt.dl_tensor = _DLTensor(ctypes.c_void_p(ptr), _DLDevice(_KDLCUDA, device_id), 1,
                                       _DLDataType(_KDLUINT, 32, 1), self._shape, None, 0)
        self._mt.deleter = _NO_DELETE
        self.device_id = device_id
        self.ptr = ptr

    def __dlpack_device__(self):
        return (_KDLCUDA, self.device_id)

    def __dlpack__(self, stream=None, **_):  # noqa: ARG002 - nothing to wait for: the page is idle
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._mt), _CAPSULE_NAME, None)
