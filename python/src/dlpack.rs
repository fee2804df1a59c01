//! Host memory of a Python tensor, borrowed through DLPack without a copy.
//!
//! The Python side (`aurora_rl/_tensors.py`) hands over every tensor as a flat,
//! contiguous `uint8` tensor or array on the host, so this module accepts exactly that
//! shape of DLPack tensor and refuses anything else with an error: it never needs strides,
//! dtypes or devices. Only the unversioned DLPack ABI (capsule name `dltensor`) is read,
//! which every producer still offers when no `max_version` is asked for.

use std::ffi::{CStr, c_void};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

const CAPSULE_NAME: &CStr = c"dltensor";
const DEVICE_CPU: i32 = 1;
const TYPE_CODE_UINT: u8 = 1;

#[repr(C)]
struct Device {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `DLTensor` of dlpack.h (ABI version 0.x, unchanged in the unversioned struct since).
#[repr(C)]
struct Tensor {
    data: *mut c_void,
    device: Device,
    ndim: i32,
    dtype: DataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

#[repr(C)]
struct ManagedTensor {
    tensor: Tensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut ManagedTensor)>,
}

/// The bytes of a host tensor, valid while this value lives: it holds the DLPack capsule,
/// and the capsule (not consumed, so still named `dltensor`) keeps the producer's tensor
/// alive until it is collected.
pub struct HostBytes<'py> {
    _capsule: Bound<'py, PyAny>,
    data: *mut u8,
    len: usize,
}

impl<'py> HostBytes<'py> {
    /// Borrows the memory of `object`, a flat contiguous `uint8` tensor on the host with a
    /// `__dlpack__` method (torch and numpy have one). `what` names it in errors.
    pub fn borrow(object: &Bound<'py, PyAny>, what: &str) -> PyResult<HostBytes<'py>> {
        let capsule = object.call_method0("__dlpack__")?;
        // SAFETY: the name is checked by `PyCapsule_GetPointer`, which returns null (with
        // a Python error set) for any other object or name.
        let managed = unsafe {
            pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), CAPSULE_NAME.as_ptr())
                as *const ManagedTensor
        };
        if managed.is_null() {
            return Err(PyErr::take(object.py()).unwrap_or_else(|| {
                PyValueError::new_err(format!("{what}: __dlpack__ returned no DLPack tensor"))
            }));
        }
        // SAFETY: a live `dltensor` capsule points at a valid `DLManagedTensor`, whose
        // shape (and strides, when present) hold `ndim` entries.
        let tensor = unsafe { &(*managed).tensor };
        let refuse = |reason: &str| Err(PyValueError::new_err(format!("{what}: {reason}")));
        if tensor.device.device_type != DEVICE_CPU {
            return refuse("the tensor is not in host memory");
        }
        if (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes) != (TYPE_CODE_UINT, 8, 1) {
            return refuse("expected the tensor's bytes as uint8");
        }
        if tensor.ndim != 1 {
            return refuse("expected the tensor's bytes flattened to one dimension");
        }
        let (len, stride) = unsafe {
            (
                *tensor.shape,
                (!tensor.strides.is_null()).then(|| *tensor.strides),
            )
        };
        let Ok(len) = usize::try_from(len) else {
            return refuse("negative length");
        };
        if len > 1 && stride.is_some_and(|stride| stride != 1) {
            return refuse("the tensor's bytes are not contiguous");
        }
        let data = if len == 0 {
            std::ptr::NonNull::<u8>::dangling().as_ptr()
        } else {
            let Ok(offset) = usize::try_from(tensor.byte_offset) else {
                return refuse("byte offset beyond the address space");
            };
            tensor.data.cast::<u8>().wrapping_add(offset)
        };
        if data.is_null() {
            return refuse("null data pointer");
        }
        Ok(HostBytes {
            _capsule: capsule,
            data,
            len,
        })
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the producer vouches for `len` bytes at `data` while the capsule lives,
        // and `borrow` replaced the pointer of an empty tensor (which may be null) with a
        // dangling, aligned one.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }

    /// The bytes to write into: only for memory the caller hands over to be written (an
    /// output buffer it allocated, an engine's parameters at a safe point).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`; `&mut self` keeps this the only view made here.
        unsafe { std::slice::from_raw_parts_mut(self.data, self.len) }
    }
}

/// What a capsule made by [`export_bytes`] owns: the DLPack tensor, its one-element shape
/// (which the tensor points at), and whatever keeps the bytes alive.
struct Exported {
    managed: ManagedTensor,
    shape: [i64; 1],
    _owner: Box<dyn std::any::Any + Send + Sync>,
}

unsafe extern "C" fn delete_exported(managed: *mut ManagedTensor) {
    // SAFETY: `managed` is the first field of an `Exported` that `export_bytes` boxed and
    // leaked; the consumer calls this once, or the capsule's destructor does if no
    // consumer took it.
    unsafe { drop(Box::from_raw((*managed).manager_ctx.cast::<Exported>())) };
}

unsafe extern "C" fn destroy_capsule(capsule: *mut pyo3::ffi::PyObject) {
    // A consumer renames the capsule when it takes the tensor over (and then calls the
    // deleter itself); one still named `dltensor` was never consumed.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, CAPSULE_NAME.as_ptr()) == 1 {
            let managed = pyo3::ffi::PyCapsule_GetPointer(capsule, CAPSULE_NAME.as_ptr())
                .cast::<ManagedTensor>();
            if let Some(deleter) = (*managed).deleter {
                deleter(managed);
            }
        }
    }
}

/// A DLPack capsule over `len` bytes at `data`, a flat read-only `uint8` host tensor
/// that keeps `owner` (which owns the bytes) alive until its consumer lets go. Consumers
/// must not write to it.
///
/// # Safety
/// `data` must stay valid for `len` bytes while `owner` lives.
pub unsafe fn export_bytes(
    py: Python<'_>,
    owner: Box<dyn std::any::Any + Send + Sync>,
    data: *const u8,
    len: usize,
) -> PyResult<Bound<'_, PyAny>> {
    let mut exported = Box::new(Exported {
        managed: ManagedTensor {
            tensor: Tensor {
                data: data.cast_mut().cast(),
                device: Device {
                    device_type: DEVICE_CPU,
                    device_id: 0,
                },
                ndim: 1,
                dtype: DataType {
                    code: TYPE_CODE_UINT,
                    bits: 8,
                    lanes: 1,
                },
                shape: std::ptr::null(),
                strides: std::ptr::null(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_exported),
        },
        shape: [i64::try_from(len).map_err(|_| PyValueError::new_err("tensor too large"))?],
        _owner: owner,
    });
    exported.managed.tensor.shape = exported.shape.as_ptr();
    let raw = Box::into_raw(exported);
    // SAFETY: `raw` is a live box; the context points back at it for the deleter.
    unsafe {
        (*raw).managed.manager_ctx = raw.cast();
        let capsule = pyo3::ffi::PyCapsule_New(
            std::ptr::addr_of_mut!((*raw).managed).cast(),
            CAPSULE_NAME.as_ptr(),
            Some(destroy_capsule),
        );
        if capsule.is_null() {
            drop(Box::from_raw(raw));
            return Err(PyErr::fetch(py));
        }
        Ok(Bound::from_owned_ptr(py, capsule))
    }
}
