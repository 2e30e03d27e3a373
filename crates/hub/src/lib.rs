//! The environment hub: environments shared like model checkpoints.
//!
//! So far this crate holds the package format ([`package`]): a directory with an
//! `openenv.yaml` packed into deterministic bytes with a manifest of hashes, unpacked
//! with every file checked. The registry service, storage, auth, validation on push and
//! leaderboards build on it.
//!
//! ```no_run
//! use std::path::Path;
//!
//! let packed = agentstack_hub::package::pack(Path::new("my_env"))?;
//! println!("{} {} ({} files)", packed.spec.name, packed.sha256, packed.manifest.files.len());
//! agentstack_hub::package::unpack(&packed.bytes, Path::new("copy_of_my_env"))?;
//! # Ok::<(), agentstack_hub::package::PackageError>(())
//! ```

pub mod package;
