pub mod bench;
pub mod inspect;
pub mod parity;
pub mod quantize;
pub mod run;
