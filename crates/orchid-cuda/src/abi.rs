//! The kernel ABI, defined once, on the Rust side: every `#[repr(C)]` argument struct a kernel
//! takes by value and every constant both sides use are declared with [`kernel_abi!`], which
//! emits the Rust items and a function returning their CUDA definitions (`struct` with the same
//! fields in the same order, `#define` for constants). `compile` prepends those definitions to
//! each kernel file before NVRTC sees it, so the two sides cannot drift apart: the kernels hold
//! no hand-written copy.
//!
//! Field types map one to one: `u64` → `u64` (device pointers and 64-bit integers), `i32` →
//! `int`, `u32` → `u32`, `f32` → `float`, `[T; N]` → `T name[N]`, a struct → the struct. A field
//! whose CUDA name differs (the kernels name dimensions in capitals: `K`, `T`, `Hq`) says so with
//! `=> "K"`; a constant likewise (`RING_SLOTS => "RING"`). Constants come first, in a
//! `const { ... }` block.

/// A type that can be a field of a kernel argument struct.
pub trait CType {
    /// The CUDA declaration of a field of this type called `name` (without the `;`).
    fn c_field(name: &str) -> String;
}

macro_rules! c_scalar {
    ($t:ty, $c:literal) => {
        impl CType for $t {
            fn c_field(name: &str) -> String {
                format!("{} {name}", $c)
            }
        }
    };
}
c_scalar!(u64, "u64");
c_scalar!(i32, "int");
c_scalar!(u32, "u32");
c_scalar!(f32, "float");

impl<T: CType, const N: usize> CType for [T; N] {
    fn c_field(name: &str) -> String {
        format!("{}[{N}]", T::c_field(name))
    }
}

/// Declares constants and `#[repr(C)]` kernel argument structs, and `$vis fn $abi() -> String`
/// returning their CUDA definitions (see the module docs). Derives are written by the caller.
#[macro_export]
macro_rules! kernel_abi {
    (
        $vis:vis fn $abi:ident;
        $( const { $( $(#[$cm:meta])* $cn:ident $(=> $cc:literal)? : $cty:ty = $cv:expr; )* } )?
        $(
            $(#[$m:meta])*
            struct $name:ident { $( $(#[$fm:meta])* $f:ident : $t:ty $(=> $fc:literal)? ),* $(,)? }
        )*
    ) => {
        $( $( $(#[$cm])* pub const $cn: $cty = $cv; )* )?
        $(
            #[repr(C)]
            $(#[$m])*
            pub struct $name { $( $(#[$fm])* pub $f: $t, )* }

            impl $crate::abi::CType for $name {
                fn c_field(name: &str) -> String {
                    format!("{} {name}", stringify!($name))
                }
            }
        )*

        /// The CUDA definitions of this group's constants and argument structs.
        $vis fn $abi() -> String {
            #[allow(unused_mut)]
            let mut s = String::new();
            $( $( s += &format!("#define {} {}\n", $crate::kernel_abi!(@name $cn $(, $cc)?), $cv); )* )?
            $(
                s += concat!("struct ", stringify!($name), " {\n");
                $( s += &format!("    {};\n", <$t as $crate::abi::CType>::c_field($crate::kernel_abi!(@name $f $(, $fc)?))); )*
                s += "};\n";
            )*
            s
        }
    };
    (@name $n:ident) => { stringify!($n) };
    (@name $n:ident, $c:literal) => { $c };
}

#[cfg(test)]
mod tests {
    crate::kernel_abi! {
        fn demo_abi;
        const {
            /// A constant with another CUDA name.
            DEMO_SLOTS => "SLOTS": usize = 4;
        }
        #[derive(Clone, Copy, Default)]
        struct DemoSeg { w: u64, rows: i32, pad: i32 }
        #[derive(Clone, Copy, Default)]
        struct DemoArgs { seg: [DemoSeg; 2], x: u64, k: i32 => "K", eps: f32 }
    }

    #[test]
    fn emits_the_cuda_definitions() {
        assert_eq!(DEMO_SLOTS, 4);
        assert_eq!(
            demo_abi(),
            "#define SLOTS 4\nstruct DemoSeg {\n    u64 w;\n    int rows;\n    int pad;\n};\nstruct DemoArgs {\n    DemoSeg seg[2];\n    u64 x;\n    int K;\n    float eps;\n};\n"
        );
        assert_eq!(std::mem::size_of::<DemoArgs>(), 2 * 16 + 8 + 8);
    }
}
