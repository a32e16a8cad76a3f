//! Opening the files a user names on the command line (native only). Before anything is opened
//! the path must be a regular file: opening a FIFO blocks until a writer comes, and reading
//! `/dev/zero` never ends, so both are refused with a message that says what the path is.

use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};

/// The size of the regular file at `path`, or an error that calls it the `what` (e.g. "model
/// file") and says why it cannot be one: missing, a directory, or not a regular file.
pub fn regular_file_len(path: &Path, what: &str) -> Result<u64> {
    let fail = |why: String| {
        Err(Error::Io { path: path.display().to_string(), source: std::io::Error::other(why) })
    };
    // `metadata` follows symlinks and never opens the file, so it cannot block on a FIFO.
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(m.len()),
        Ok(m) if m.is_dir() => fail(format!("is a directory, not a {what}")),
        Ok(_) => fail(format!(
            "is not a regular file (a device, FIFO or socket), so it cannot be a {what}"
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            fail(format!("the {what} does not exist"))
        }
        Err(source) => Err(Error::Io { path: path.display().to_string(), source }),
    }
}

/// The bytes of the regular file at `path` (see [`regular_file_len`]), refused when larger
/// than `max_bytes`: a file that size is not what was asked for, and would only fill memory.
pub fn read_capped(path: &Path, what: &str, max_bytes: u64) -> Result<Vec<u8>> {
    let len = regular_file_len(path, what)?;
    let too_big = |len: u64| {
        Error::Input(format!(
            "{}: {len} bytes is too large for a {what} (the limit is {} MiB)",
            path.display(),
            max_bytes >> 20
        ))
    };
    if len > max_bytes {
        return Err(too_big(len));
    }
    let io = |source| Error::Io { path: path.display().to_string(), source };
    let mut bytes = Vec::with_capacity(len as usize);
    // `take`: the file may have grown since it was measured.
    std::fs::File::open(path)
        .map_err(io)?
        .take(max_bytes + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > max_bytes {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

/// [`read_capped`] as UTF-8 text.
pub fn read_text_capped(path: &Path, what: &str, max_bytes: u64) -> Result<String> {
    String::from_utf8(read_capped(path, what, max_bytes)?)
        .map_err(|_| Error::Input(format!("{}: the {what} is not UTF-8 text", path.display())))
}
