//! Running a node tool (`iptables-restore`, `ip`, `ipset`, `nft`, ...) directly, never through a
//! shell: the program with its arguments as given, optional input on stdin, stdout and stderr
//! captured — or, for a listing too large to hold ([`each_line`]), stdout handed over line by
//! line as the tool prints it. The backends turn an [`Error`] into their own error types.

use std::io::{self, BufRead, BufReader, Read, Write};
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

/// Runs `program args...` (stdin `/dev/null`) and hands each line of its standard output to
/// `each` (without the newline, lossy UTF-8) as it arrives: `iptables-save` prints 33 MB at
/// 10,000 Services × 10 endpoints, which the caller need not hold. Standard error is collected
/// beside (on a thread, so that neither pipe can fill up and stall the tool); a non-zero exit is
/// [`Error::Failed`], after every line it printed was handed over.
pub fn each_line<S: AsRef<str>>(program: &str, args: &[S], mut each: impl FnMut(&str)) -> Result<(), Error> {
    let spawn_err = |source| Error::Spawn {
        program: program.to_string(),
        source,
    };
    let mut child = Command::new(program)
        .args(args.iter().map(AsRef::as_ref))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_err)?;
    let stderr = child.stderr.take().map(|mut pipe| {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            let _ = pipe.read_to_end(&mut text);
            text
        })
    });
    let mut read_result = Ok(());
    if let Some(stdout) = child.stdout.take() {
        let mut reader = BufReader::with_capacity(64 << 10, stdout);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) => break,
                Ok(_) => {
                    let text = String::from_utf8_lossy(&line);
                    each(text.strip_suffix('\n').unwrap_or(&text));
                }
                Err(e) => {
                    read_result = Err(e);
                    break;
                }
            }
        }
    }
    let status = child.wait().map_err(spawn_err)?;
    read_result.map_err(spawn_err)?;
    let stderr = stderr.and_then(|t| t.join().ok()).unwrap_or_default();
    if status.success() {
        return Ok(());
    }
    Err(Error::Failed {
        program: program.to_string(),
        args: args.iter().map(|a| a.as_ref().to_string()).collect(),
        status,
        stderr: String::from_utf8_lossy(&stderr).trim().to_string(),
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

    #[test]
    fn each_line_hands_over_every_line_and_then_the_failure() {
        let mut lines = Vec::new();
        each_line("sh", &["-c", "printf 'a\\nb b\\n\\nlast'"], |l| {
            lines.push(l.to_string())
        })
        .expect("runs");
        assert_eq!(lines, ["a", "b b", "", "last"]);
        // More than a pipe holds on both outputs at once: nothing stalls.
        let mut n = 0;
        each_line(
            "sh",
            &[
                "-c",
                "i=0; while [ $i -lt 20000 ]; do echo out$i; echo err$i >&2; i=$((i+1)); done",
            ],
            |_| n += 1,
        )
        .expect("runs");
        assert_eq!(n, 20000);
        let mut seen = Vec::new();
        let err = each_line("sh", &["-c", "echo partial; echo broken >&2; exit 4"], |l| {
            seen.push(l.to_string())
        })
        .expect_err("fails");
        assert_eq!(seen, ["partial"]);
        assert!(
            matches!(&err, Error::Failed { status, stderr, .. } if status.code() == Some(4) && stderr == "broken"),
            "{err:?}"
        );
        assert!(matches!(
            each_line::<&str>("/nonexistent/tool", &[], |_| {}),
            Err(Error::Spawn { .. })
        ));
    }
}
