//! The protocol's byte-valued enums, each written once: its variants with their wire bytes
//! (and names, where it has them), from which `ALL`, `COUNT`, `from_wire` and `as_str` follow,
//! so a variant added to the enum cannot be missing from the tables that read it.

/// Declares a `#[repr(u8)]` enum of the protocol with `ALL` (wire order), `COUNT` and
/// `from_wire`; with `=> "name"` on every variant, also `as_str`.
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident = $value:literal => $label:literal,)+
        }
    ) => {
        wire_enum! {
            $(#[$meta])*
            pub enum $name {
                $($(#[$vmeta])* $variant = $value,)+
            }
        }

        impl $name {
            /// The variant's stable name, as in JSON answers, metric labels and `limiter
            /// check`'s output.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $label,)+
                }
            }
        }
    };
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident = $value:literal,)+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum $name {
            $($(#[$vmeta])* $variant = $value,)+
        }

        impl $name {
            /// Every variant, in wire order.
            pub const ALL: [$name; $name::COUNT] = [$($name::$variant),+];
            /// Number of variants.
            pub const COUNT: usize = [$($value),+].len();

            /// The variant for a wire byte, or `None` for a byte no version of the protocol
            /// uses.
            pub fn from_wire(value: u8) -> Option<Self> {
                match value {
                    $($value => Some($name::$variant),)+
                    _ => None,
                }
            }
        }
    };
}
