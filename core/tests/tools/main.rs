//! The built-in tools, run through [`keel_core::tool::builtins`] against real temporary
//! directories; one file per tool, and one for what they share.

mod support;

mod bash;
mod confinement;
mod input;
mod read;
mod sandbox;
mod search;
mod write;
