//! Running a node tool (`iptables-restore`, `ip`, `ipset`, `nft`, ...) directly, never through a
//! shell: the program with its arguments as given, optional input on stdin, stdout and stderr
//! captured. The backends turn an [`Error`] into their own error types.

use std::io::{self, Write};
use std::process::{Command, ExitStatus, Stdio};

/// How a tool ended and what it printed.
#[derive(Debug)]
pub struct Output {
    pub status: ExitStatus,
    /// Standard output, as (lossy) UTF-8.
    pub stdout: String,
    /// Standard error, as (lossy) UTF-8, trimmed.
    pub stderr: String,
}

/// A tool that could not be run, or that ran and failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// It could not be started (not installed, not allowed, ...) or waited for.
    #[error("running {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: io::Error,
    },
    /// It exited unsuccessfully.
    #[error("`{program} {}` failed ({status}): {stderr}", args.join(" "))]
    Failed {
        program: String,
        args: Vec<String>,
        status: ExitStatus,
        /// Its standard error, trimmed.
        stderr: String,
    },
}

/// Runs `program args...` to completion with `stdin` as its input (none: `/dev/null`) and
/// returns how it ended, successfully or not; an error only when it cannot be run.
pub fn output<S: AsRef<str>>(program: &str, args: &[S], stdin: Option<&str>) -> Result<Output, Error> {
    let spawn_err = |source| Error::Spawn {
        program: program.to_string(),
        source,
    };
    let mut child = Command::new(program)
        .args(args.iter().map(AsRef::as_ref))
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_err)?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // A tool that exits early closes the pipe; its exit status tells what happened.
        let _ = pipe.write_all(input.as_bytes());
    }
    let out = child.wait_with_output().map_err(spawn_err)?;
    Ok(Output {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    })
}

/// [`output`] for a tool that must succeed: its stdout, or [`Error::Failed`] with its stderr.
pub fn run<S: AsRef<str>>(program: &str, args: &[S], stdin: Option<&str>) -> Result<String, Error> {
    let out = output(program, args, stdin)?;
    if out.status.success() {
        return Ok(out.stdout);
    }
    Err(Error::Failed {
        program: program.to_string(),
        args: args.iter().map(|a| a.as_ref().to_string()).collect(),
        status: out.status,
        stderr: out.stderr,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stdin_stdout_and_the_failure_with_its_stderr() {
        assert_eq!(run("cat", &["-"], Some("in\n")).expect("cat runs"), "in\n");
        assert_eq!(run::<&str>("true", &[], None).expect("true runs"), "");
        let err = run("sh", &["-c", "echo out; echo ' oops ' >&2; exit 3"], None).expect_err("fails");
        let Error::Failed {
            ref program,
            ref args,
            status,
            ref stderr,
        } = err
        else {
            panic!("{err:?}");
        };
        assert_eq!(
            (program.as_str(), args.len(), status.code(), stderr.as_str()),
            ("sh", 2, Some(3), "oops")
        );
        assert_eq!(
            err.to_string(),
            "`sh -c echo out; echo ' oops ' >&2; exit 3` failed (exit status: 3): oops"
        );
        let out = output("sh", &["-c", "echo out; exit 1"], None).expect("runs");
        assert_eq!((out.status.success(), out.stdout.as_str()), (false, "out\n"));
        assert!(matches!(
            run::<&str>("/nonexistent/tool", &[], Some("x")),
            Err(Error::Spawn { .. })
        ));
    }
}
