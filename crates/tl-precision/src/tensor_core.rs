//! [`Accumulation`]: how the products under autocast add up — in f32 as a CPU GEMM does, as
//! Intel's AMX tiles do, or as a tensor core of a given GPU does, emulated exactly by
//! tl-numerics' [`BlockFma`].
//!
//! Under [`autocast_with`](crate::autocast_with) and a tensor-core model, every product reads
//! its 16-bit operands, adds them up block by block as the GPU's multiply-accumulate
//! instruction does (exact products, aligned to the block's largest exponent, truncated), and
//! the binary32 result is rounded to the 16-bit format as before. The two products of the
//! backward pass take the same model, so the gradients are the ones the GPU would produce.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tl_numerics::{BlockFma, Format};
use tl_tensor::ProductKernel;
use tl_tensor::kernels::bf16_dot::{AmxProducts, Bf16Products};

use crate::error::{PrecisionError, Result};

/// How the products of autocast accumulate.
///
/// Parsed from and displayed as `"f32"`, `"amx"`, `"v100"`, `"a100"`, `"h100"` or
/// `"tensor-core:BLOCK:EXTRA_BITS"`.
///
/// ```
/// use tl_precision::Accumulation;
///
/// let h100: Accumulation = "h100".parse()?;
/// assert_eq!(h100, Accumulation::H100);
/// assert_eq!(h100.block_fma()?.map(|f| (f.block(), f.extra_bits())), Some((16, 2)));
/// let custom: Accumulation = "tensor-core:32:3".parse()?;
/// assert_eq!(custom, Accumulation::TensorCore { block: 32, extra_bits: 3 });
/// assert_eq!(custom.to_string(), "tensor-core:32:3");
/// assert!("a100 ".parse::<Accumulation>().is_err());
/// # Ok::<(), tl_precision::PrecisionError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Accumulation {
    /// Products accumulated in f32, each addition rounded to nearest (a CPU's GEMM, and the
    /// default): bf16 products in the order of the CPU's bf16 units (on them where the CPU
    /// has them), others in the GEMM's own order.
    #[default]
    F32,
    /// Intel AMX's tiles (`tdpbf16ps`), bf16 operands only: per block of 32 products, an
    /// even and an odd f32 sum, their sum added to the accumulator, every addition rounded
    /// to nearest (tl-tensor's `amx_gemm`). On the tiles where the CPU has them, emulated
    /// bit for bit elsewhere: what PyTorch's bf16 products compute on such a CPU.
    Amx,
    /// NVIDIA V100's tensor cores: blocks of 4 products, no extra alignment bit.
    V100,
    /// NVIDIA A100's: blocks of 8, one extra bit.
    A100,
    /// NVIDIA H100's: blocks of 16, two extra bits.
    H100,
    /// A block FMA of `block` products with `extra_bits` extra alignment bits.
    TensorCore {
        /// Products added at once.
        block: usize,
        /// Alignment bits beyond binary32's 24.
        extra_bits: u32,
    },
}

impl Accumulation {
    /// The named models, in a fixed order.
    pub const NAMED: [Accumulation; 5] = [
        Accumulation::F32,
        Accumulation::Amx,
        Accumulation::V100,
        Accumulation::A100,
        Accumulation::H100,
    ];

    /// The block FMA of a tensor-core model, `None` for [`F32`](Accumulation::F32) and
    /// [`Amx`](Accumulation::Amx).
    ///
    /// # Errors
    /// [`PrecisionError::Format`] wrapping tl-numerics' `InvalidBlockFma` for a
    /// [`TensorCore`](Accumulation::TensorCore) with a block of 0 or too many extra bits.
    pub fn block_fma(self) -> Result<Option<BlockFma>> {
        Ok(match self {
            Accumulation::F32 | Accumulation::Amx => None,
            Accumulation::V100 => Some(BlockFma::V100),
            Accumulation::A100 => Some(BlockFma::A100),
            Accumulation::H100 => Some(BlockFma::H100),
            Accumulation::TensorCore { block, extra_bits } => {
                Some(BlockFma::new(block, extra_bits)?)
            }
        })
    }

    /// Whether the hardware this models multiplies `format` on its units: a V100 has no
    /// bf16 mode, AMX-BF16 no other. `F32` and custom models take any format.
    pub fn supports(self, format: Format) -> bool {
        match self {
            Accumulation::V100 => format != Format::Bf16,
            Accumulation::Amx => format == Format::Bf16,
            _ => true,
        }
    }

    /// The product kernel of this model for operands of `format`: what autocast multiplies
    /// with, and what a fused op that computes its own products (an attention kernel) takes
    /// to multiply as autocast does. `None` means the plain GEMM.
    ///
    /// `F32` has a kernel for bf16 operands: tl-tensor's [`Bf16Products`], which sums in f32
    /// in the order of the CPU's bf16 units and runs on them where the CPU has them (the
    /// same bits on every CPU). fp16 operands have no such units on a CPU, so `F32` keeps the
    /// plain GEMM for them. `Amx` has tl-tensor's [`AmxProducts`] for bf16 operands, on the
    /// tiles where the CPU has them, and takes no other format ([`supports`](Self::supports)).
    ///
    /// # Errors
    /// As [`block_fma`](Self::block_fma).
    pub fn product_kernel(self, format: Format) -> Result<Option<Arc<dyn ProductKernel>>> {
        if self == Accumulation::F32 {
            return Ok((format == Format::Bf16).then(|| {
                let kernel: Arc<dyn ProductKernel> = Arc::new(Bf16Products);
                kernel
            }));
        }
        if self == Accumulation::Amx {
            return Ok((format == Format::Bf16).then(|| {
                let kernel: Arc<dyn ProductKernel> = Arc::new(AmxProducts);
                kernel
            }));
        }
        Ok(self.block_fma()?.map(|fma| {
            let kernel: Arc<dyn ProductKernel> = Arc::new(TensorCoreProduct { fma, format });
            kernel
        }))
    }
}

impl fmt::Display for Accumulation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Accumulation::F32 => f.write_str("f32"),
            Accumulation::Amx => f.write_str("amx"),
            Accumulation::V100 => f.write_str("v100"),
            Accumulation::A100 => f.write_str("a100"),
            Accumulation::H100 => f.write_str("h100"),
            Accumulation::TensorCore { block, extra_bits } => {
                write!(f, "tensor-core:{block}:{extra_bits}")
            }
        }
    }
}

impl FromStr for Accumulation {
    type Err = PrecisionError;

    /// Parses exactly `"f32"`, `"amx"`, `"v100"`, `"a100"`, `"h100"` or `"tensor-core:B:X"` with a
    /// valid block `B` and extra bits `X`.
    ///
    /// # Errors
    /// [`PrecisionError::UnknownAccumulation`] for any other text, or an invalid block.
    fn from_str(s: &str) -> Result<Self> {
        let unknown = || PrecisionError::UnknownAccumulation {
            input: s.to_owned(),
        };
        if let Some(named) = Accumulation::NAMED.into_iter().find(|a| a.to_string() == s) {
            return Ok(named);
        }
        let rest = s.strip_prefix("tensor-core:").ok_or_else(unknown)?;
        let (block, extra) = rest.split_once(':').ok_or_else(unknown)?;
        let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
        if !(digits(block) && digits(extra)) {
            return Err(unknown());
        }
        let model = Accumulation::TensorCore {
            block: block.parse().map_err(|_| unknown())?,
            extra_bits: extra.parse().map_err(|_| unknown())?,
        };
        model.block_fma().map_err(|_| unknown())?;
        Ok(model)
    }
}

/// The product kernel of a tensor-core model: tl-numerics' block-FMA GEMM.
#[derive(Debug)]
struct TensorCoreProduct {
    fma: BlockFma,
    format: Format,
}

impl ProductKernel for TensorCoreProduct {
    fn product_f32(
        &self,
        m: usize,
        k: usize,
        n: usize,
        lhs: &[f32],
        rhs: &[f32],
        out: &mut [f32],
        accumulate: bool,
    ) {
        if accumulate {
            self.fma
                .gemm_accumulate(self.format, m, k, n, lhs, rhs, out);
        } else {
            self.fma.gemm(self.format, m, k, n, lhs, rhs, out);
        }
    }

    fn product_f64(
        &self,
        m: usize,
        k: usize,
        n: usize,
        lhs: &[f64],
        rhs: &[f64],
        out: &mut [f64],
        accumulate: bool,
    ) {
        if accumulate {
            self.fma
                .gemm_accumulate(self.format, m, k, n, lhs, rhs, out);
        } else {
            self.fma.gemm(self.format, m, k, n, lhs, rhs, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bad_ones_are_refused() {
        for a in Accumulation::NAMED {
            assert_eq!(a.to_string().parse::<Accumulation>(), Ok(a));
        }
        let custom = Accumulation::TensorCore {
            block: 4,
            extra_bits: 3,
        };
        assert_eq!(custom.to_string().parse::<Accumulation>(), Ok(custom));
        for bad in [
            "H100",
            "tensor-core:0:0",
            "tensor-core:4",
            "tensor-core:4:99",
            "tensor-core:-4:1",
            "tensor-core:4:1:",
            "",
        ] {
            assert_eq!(
                bad.parse::<Accumulation>(),
                Err(PrecisionError::UnknownAccumulation { input: bad.into() }),
                "{bad}"
            );
        }
        let error = "tensor-core:0:0".parse::<Accumulation>().unwrap_err();
        assert!(error.to_string().contains("h100"), "{error}");
    }

    #[test]
    fn the_presets_are_the_papers_models_and_f32_has_none() {
        assert_eq!(Accumulation::F32.block_fma(), Ok(None));
        assert_eq!(Accumulation::V100.block_fma(), Ok(Some(BlockFma::V100)));
        assert_eq!(Accumulation::A100.block_fma(), Ok(Some(BlockFma::A100)));
        assert_eq!(Accumulation::H100.block_fma(), Ok(Some(BlockFma::H100)));
        assert!(
            Accumulation::TensorCore {
                block: 0,
                extra_bits: 0
            }
            .block_fma()
            .is_err()
        );
        assert!(!Accumulation::V100.supports(Format::Bf16));
        assert!(Accumulation::V100.supports(Format::Fp16));
        assert!(Accumulation::H100.supports(Format::Bf16));
        // AMX-BF16: bf16 only, and no block FMA: its own kernel.
        assert_eq!(Accumulation::Amx.block_fma(), Ok(None));
        assert!(Accumulation::Amx.supports(Format::Bf16));
        assert!(!Accumulation::Amx.supports(Format::Fp16));
        let kernel = Accumulation::Amx.product_kernel(Format::Bf16).unwrap();
        assert_eq!(format!("{:?}", kernel.unwrap()), "AmxProducts");
    }

    #[test]
    fn serde_names_are_stable() {
        let json = serde_json::to_string(&Accumulation::H100).unwrap();
        assert_eq!(json, "\"h100\"");
        let json = serde_json::to_string(&Accumulation::Amx).unwrap();
        assert_eq!(json, "\"amx\"");
        let custom = Accumulation::TensorCore {
            block: 8,
            extra_bits: 3,
        };
        let json = serde_json::to_string(&custom).unwrap();
        assert_eq!(json, r#"{"tensor_core":{"block":8,"extra_bits":3}}"#);
        assert_eq!(serde_json::from_str::<Accumulation>(&json).unwrap(), custom);
    }
}
