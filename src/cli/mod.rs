pub mod inspect;
pub mod quantize;
pub mod run;
