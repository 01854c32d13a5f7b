//! The WASI a filter gets: the `wasi:io` and `wasi:cli` interfaces a Rust `std` guest
//! imports even when it does not use them, implemented as synchronous stubs that grant
//! nothing (`wasi-stubs/world.wit`).
//!
//! - no environment, arguments or working directory;
//! - stdin is closed;
//! - stdout and stderr append to one small buffer, read only to tell a Rust panic
//!   from another trap;
//! - every pollable is ready, so nothing ever blocks;
//! - `exit` ends the call as a trap.
//!
//! Being synchronous, they let a filter be instantiated and called on the worker itself,
//! without a fiber or a future.

use wasmtime::component::{HasData, Linker, Resource, ResourceTable};

use crate::runtime::State;

wasmtime::component::bindgen!({
    path: "wasi-stubs",
    world: "stubs",
    imports: { default: trappable },
    trappable_error_type: { "wasi:io/streams.stream-error" => StreamError },
    with: {
        "wasi:io/error.error": IoError,
        "wasi:io/poll.pollable": Pollable,
        "wasi:io/streams.input-stream": InputStream,
        "wasi:io/streams.output-stream": OutputStream,
        "wasi:cli/terminal-input.terminal-input": TerminalInput,
        "wasi:cli/terminal-output.terminal-output": TerminalOutput,
    },
});

use wasi::cli::{environment, exit, stderr, stdin, stdout, terminal_input, terminal_output};
use wasi::cli::{terminal_stderr, terminal_stdin, terminal_stdout};
use wasi::io::{error, poll, streams};

/// Bytes of stdout and stderr kept per call.
pub const OUTPUT_CAP: usize = 4096;

/// An error resource (never created: no stream operation fails with one).
pub struct IoError;
/// A pollable: always ready.
pub struct Pollable;
/// stdin: closed.
pub struct InputStream;
/// stdout or stderr: into the call's output buffer.
pub struct OutputStream;
/// A terminal input (never created: no stream is a terminal).
pub struct TerminalInput;
/// A terminal output (never created).
pub struct TerminalOutput;

/// The stream error of `wasi:io/streams`, as a trappable error.
#[derive(Debug)]
pub enum StreamError {
    /// The stream is closed.
    Closed,
    /// Ends the call.
    Trap(wasmtime::Error),
}

impl From<wasmtime::Error> for StreamError {
    fn from(e: wasmtime::Error) -> Self {
        StreamError::Trap(e)
    }
}

impl From<wasmtime::component::ResourceTableError> for StreamError {
    fn from(e: wasmtime::component::ResourceTableError) -> Self {
        StreamError::Trap(e.into())
    }
}

type StreamResult<T> = Result<T, StreamError>;

/// The part of a call's state the stubs use.
pub struct Cx<'a> {
    table: &'a mut ResourceTable,
    output: &'a mut Vec<u8>,
}

struct HasStubs;

impl HasData for HasStubs {
    type Data<'a> = Cx<'a>;
}

/// Links every stub into `linker`.
pub fn add_to_linker(linker: &mut Linker<State>) -> wasmtime::Result<()> {
    fn get(s: &mut State) -> Cx<'_> {
        let (table, output) = s.stubs();
        Cx { table, output }
    }
    Stubs::add_to_linker::<State, HasStubs>(linker, get)
}

impl Cx<'_> {
    fn push<T: Send + 'static>(&mut self, v: T) -> wasmtime::Result<Resource<T>> {
        Ok(self.table.push(v)?)
    }

    fn drop_resource<T: 'static>(&mut self, r: Resource<T>) -> wasmtime::Result<()> {
        self.table.delete(r)?;
        Ok(())
    }

    fn write(&mut self, bytes: &[u8]) {
        let room = OUTPUT_CAP.saturating_sub(self.output.len());
        self.output.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }
}

impl streams::Host for Cx<'_> {
    fn convert_stream_error(&mut self, err: StreamError) -> wasmtime::Result<streams::StreamError> {
        match err {
            StreamError::Closed => Ok(streams::StreamError::Closed),
            StreamError::Trap(e) => Err(e),
        }
    }
}

impl streams::HostInputStream for Cx<'_> {
    fn read(&mut self, _: Resource<InputStream>, _: u64) -> StreamResult<Vec<u8>> {
        Err(StreamError::Closed)
    }
    fn blocking_read(&mut self, _: Resource<InputStream>, _: u64) -> StreamResult<Vec<u8>> {
        Err(StreamError::Closed)
    }
    fn skip(&mut self, _: Resource<InputStream>, _: u64) -> StreamResult<u64> {
        Err(StreamError::Closed)
    }
    fn blocking_skip(&mut self, _: Resource<InputStream>, _: u64) -> StreamResult<u64> {
        Err(StreamError::Closed)
    }
    fn subscribe(&mut self, _: Resource<InputStream>) -> wasmtime::Result<Resource<Pollable>> {
        self.push(Pollable)
    }
    fn drop(&mut self, r: Resource<InputStream>) -> wasmtime::Result<()> {
        self.drop_resource(r)
    }
}

impl streams::HostOutputStream for Cx<'_> {
    fn check_write(&mut self, _: Resource<OutputStream>) -> StreamResult<u64> {
        Ok(OUTPUT_CAP as u64)
    }
    fn write(&mut self, _: Resource<OutputStream>, contents: Vec<u8>) -> StreamResult<()> {
        Cx::write(self, &contents);
        Ok(())
    }
    fn blocking_write_and_flush(&mut self, _: Resource<OutputStream>, contents: Vec<u8>) -> StreamResult<()> {
        Cx::write(self, &contents);
        Ok(())
    }
    fn flush(&mut self, _: Resource<OutputStream>) -> StreamResult<()> {
        Ok(())
    }
    fn blocking_flush(&mut self, _: Resource<OutputStream>) -> StreamResult<()> {
        Ok(())
    }
    fn subscribe(&mut self, _: Resource<OutputStream>) -> wasmtime::Result<Resource<Pollable>> {
        self.push(Pollable)
    }
    fn write_zeroes(&mut self, _: Resource<OutputStream>, _: u64) -> StreamResult<()> {
        Ok(())
    }
    fn blocking_write_zeroes_and_flush(&mut self, _: Resource<OutputStream>, _: u64) -> StreamResult<()> {
        Ok(())
    }
    fn splice(&mut self, _: Resource<OutputStream>, _: Resource<InputStream>, _: u64) -> StreamResult<u64> {
        Err(StreamError::Closed)
    }
    fn blocking_splice(&mut self, _: Resource<OutputStream>, _: Resource<InputStream>, _: u64) -> StreamResult<u64> {
        Err(StreamError::Closed)
    }
    fn drop(&mut self, r: Resource<OutputStream>) -> wasmtime::Result<()> {
        self.drop_resource(r)
    }
}

impl error::Host for Cx<'_> {}

impl error::HostError for Cx<'_> {
    fn to_debug_string(&mut self, _: Resource<IoError>) -> wasmtime::Result<String> {
        Ok(String::new())
    }
    fn drop(&mut self, r: Resource<IoError>) -> wasmtime::Result<()> {
        self.drop_resource(r)
    }
}

impl poll::Host for Cx<'_> {
    fn poll(&mut self, list: Vec<Resource<Pollable>>) -> wasmtime::Result<Vec<u32>> {
        Ok((0..u32::try_from(list.len()).unwrap_or(u32::MAX)).collect())
    }
}

impl poll::HostPollable for Cx<'_> {
    fn ready(&mut self, _: Resource<Pollable>) -> wasmtime::Result<bool> {
        Ok(true)
    }
    fn block(&mut self, _: Resource<Pollable>) -> wasmtime::Result<()> {
        Ok(())
    }
    fn drop(&mut self, r: Resource<Pollable>) -> wasmtime::Result<()> {
        self.drop_resource(r)
    }
}

impl environment::Host for Cx<'_> {
    fn get_environment(&mut self) -> wasmtime::Result<Vec<(String, String)>> {
        Ok(Vec::new())
    }
    fn get_arguments(&mut self) -> wasmtime::Result<Vec<String>> {
        Ok(Vec::new())
    }
    fn initial_cwd(&mut self) -> wasmtime::Result<Option<String>> {
        Ok(None)
    }
}

/// Raised when a filter calls `exit`.
#[derive(Debug, thiserror::Error)]
#[error("filter called exit")]
pub struct Exited;

impl exit::Host for Cx<'_> {
    fn exit(&mut self, _: Result<(), ()>) -> wasmtime::Result<()> {
        Err(wasmtime::Error::new(Exited))
    }
    fn exit_with_code(&mut self, _: u8) -> wasmtime::Result<()> {
        Err(wasmtime::Error::new(Exited))
    }
}

impl stdin::Host for Cx<'_> {
    fn get_stdin(&mut self) -> wasmtime::Result<Resource<InputStream>> {
        self.push(InputStream)
    }
}

impl stdout::Host for Cx<'_> {
    fn get_stdout(&mut self) -> wasmtime::Result<Resource<OutputStream>> {
        self.push(OutputStream)
    }
}

impl stderr::Host for Cx<'_> {
    fn get_stderr(&mut self) -> wasmtime::Result<Resource<OutputStream>> {
        self.push(OutputStream)
    }
}

impl terminal_input::Host for Cx<'_> {}
impl terminal_input::HostTerminalInput for Cx<'_> {
    fn drop(&mut self, r: Resource<TerminalInput>) -> wasmtime::Result<()> {
        self.drop_resource(r)
    }
}
impl terminal_output::Host for Cx<'_> {}
impl terminal_output::HostTerminalOutput for Cx<'_> {
    fn drop(&mut self, r: Resource<TerminalOutput>) -> wasmtime::Result<()> {
        self.drop_resource(r)
    }
}
impl terminal_stdin::Host for Cx<'_> {
    fn get_terminal_stdin(&mut self) -> wasmtime::Result<Option<Resource<TerminalInput>>> {
        Ok(None)
    }
}
impl terminal_stdout::Host for Cx<'_> {
    fn get_terminal_stdout(&mut self) -> wasmtime::Result<Option<Resource<TerminalOutput>>> {
        Ok(None)
    }
}
impl terminal_stderr::Host for Cx<'_> {
    fn get_terminal_stderr(&mut self) -> wasmtime::Result<Option<Resource<TerminalOutput>>> {
        Ok(None)
    }
}
