//! Element types the delta format knows, with their wire codes (docs/delta-format.md §3).

use crate::error::{DeltaError, Result};

/// A tensor element type. The discriminant is the wire code and never changes meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[repr(u8)]
pub enum Dtype {
    Bool = 1,
    U8 = 2,
    I8 = 3,
    I16 = 4,
    U16 = 5,
    F16 = 6,
    Bf16 = 7,
    I32 = 8,
    U32 = 9,
    F32 = 10,
    F64 = 11,
    I64 = 12,
    U64 = 13,
    F8E5M2 = 14,
    F8E4M3 = 15,
}

/// Where a floating-point type keeps its exponent, so the codec can use the exponent of the
/// base value as coding context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FloatLayout {
    pub exponent_mask: u32,
    pub exponent_shift: u32,
}

impl Dtype {
    pub const ALL: [Dtype; 15] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::Bf16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
        Dtype::F8E5M2,
        Dtype::F8E4M3,
    ];

    pub fn size_bytes(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 | Dtype::F8E5M2 | Dtype::F8E4M3 => 1,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
        }
    }

    pub fn from_code(code: u8) -> Result<Dtype> {
        Dtype::ALL
            .into_iter()
            .find(|d| *d as u8 == code)
            .ok_or_else(|| DeltaError::Malformed(format!("unknown dtype code {code}")))
    }

    /// The dtype a safetensors name ([`Dtype::name`]) stands for.
    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::Bf16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::F8E4M3 => "F8_E4M3",
        }
    }

    /// The float types the context-modelled `aurora` encoding handles; everything else is
    /// carried by the `leb128` or dense encodings.
    pub(crate) fn float_layout(self) -> Option<FloatLayout> {
        match self {
            Dtype::Bf16 => Some(FloatLayout {
                exponent_mask: 0x7F80,
                exponent_shift: 7,
            }),
            Dtype::F16 => Some(FloatLayout {
                exponent_mask: 0x7C00,
                exponent_shift: 10,
            }),
            Dtype::F32 => Some(FloatLayout {
                exponent_mask: 0x7F80_0000,
                exponent_shift: 23,
            }),
            _ => None,
        }
    }

    pub fn from_safetensors(dtype: safetensors::Dtype) -> Result<Dtype> {
        use safetensors::Dtype as S;
        Ok(match dtype {
            S::BOOL => Dtype::Bool,
            S::U8 => Dtype::U8,
            S::I8 => Dtype::I8,
            S::I16 => Dtype::I16,
            S::U16 => Dtype::U16,
            S::F16 => Dtype::F16,
            S::BF16 => Dtype::Bf16,
            S::I32 => Dtype::I32,
            S::U32 => Dtype::U32,
            S::F32 => Dtype::F32,
            S::F64 => Dtype::F64,
            S::I64 => Dtype::I64,
            S::U64 => Dtype::U64,
            S::F8_E5M2 => Dtype::F8E5M2,
            S::F8_E4M3 => Dtype::F8E4M3,
            other => {
                return Err(DeltaError::Checkpoint(format!(
                    "dtype {other:?} is not supported by the delta format"
                )));
            }
        })
    }

    pub fn to_safetensors(self) -> safetensors::Dtype {
        use safetensors::Dtype as S;
        match self {
            Dtype::Bool => S::BOOL,
            Dtype::U8 => S::U8,
            Dtype::I8 => S::I8,
            Dtype::I16 => S::I16,
            Dtype::U16 => S::U16,
            Dtype::F16 => S::F16,
            Dtype::Bf16 => S::BF16,
            Dtype::I32 => S::I32,
            Dtype::U32 => S::U32,
            Dtype::F32 => S::F32,
            Dtype::F64 => S::F64,
            Dtype::I64 => S::I64,
            Dtype::U64 => S::U64,
            Dtype::F8E5M2 => S::F8_E5M2,
            Dtype::F8E4M3 => S::F8_E4M3,
        }
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_codes_round_trip_and_are_unique() {
        for dtype in Dtype::ALL {
            assert_eq!(Dtype::from_code(dtype as u8).unwrap(), dtype);
            assert_eq!(
                Dtype::from_safetensors(dtype.to_safetensors()).unwrap(),
                dtype
            );
        }
        assert!(Dtype::from_code(0).is_err());
        assert!(Dtype::from_code(200).is_err());
    }
}
