'use strict';
// The JavaScript side of a code-host context (see code_host.py): a persistent node REPL.
//
// Requests arrive and replies leave as JSON lines on the socket whose fd is argv[2]:
//   {"op": "execute", "code", "envs", "marker"} -> {"event": "result"|"error", ...}*,
//                                                   {"event": "done"}
//   {"op": "env", "envs"} -> nothing (applied in order with the cells)
// A cell's console output goes to the real stdout/stderr, which code_host.py streams. Node may
// queue pipe writes, so the end of a cell's output is marked in-band: `marker` + "\n" is written
// to stdout and to stderr after the cell, before "done".
//
// Cells run in node's main realm with vm.Script#runInThisContext, so state persists:
// - `var` and `function` declarations become globals; column-0 `let`/`const`/`class` are
//   rewritten to `var` so a cell can be re-run without "Identifier has already been declared";
// - the value of the last expression statement is the cell's result (util.inspect text);
// - top-level `await` works through node's own REPL rewriter (node --expose-internals), which
//   hoists the declarations out of the async wrapper; without it, such a cell is a SyntaxError.
// Interrupts are SIGINT: `breakOnSigint` stops synchronous code without losing the context, and
// an awaited promise is abandoned (its continuation may still run and print later). One that
// lands before the cell starts running stops it as it starts; one between cells is ignored. A
// sync loop after an `await` cannot be interrupted; code_host.py then kills the process.
//
// Only features of node 18 are used.

const vm = require('vm');
const util = require('util');
const net = require('net');
const path = require('path');
const { createRequire } = require('module');

// Captured now: cells run in this realm and may reassign globals.
const stringify = JSON.stringify;
const parse = JSON.parse;
const inspect = util.inspect;
const stdoutWrite = process.stdout.write.bind(process.stdout);
const stderrWrite = process.stderr.write.bind(process.stderr);

let processTopLevelAwait = null;
try {
  ({ processTopLevelAwait } = require('internal/repl/await'));
} catch (_) {
  // started without --expose-internals: no top-level await
}

const chan = new net.Socket({ fd: Number(process.argv[2]), readable: true, writable: true });
const send = (msg) => chan.write(stringify(msg) + '\n');

globalThis.require = createRequire(path.join(process.cwd(), '[cell]'));

let cellNo = 0;
let abandon = null; // rejects the promise an async cell is awaiting
let inFlight = 0; // execute requests received and not yet done
let interruptPending = false;

function interrupted() {
  const err = new Error('execution interrupted');
  err.name = 'Interrupted';
  return err;
}

process.on('SIGINT', () => {
  if (abandon) abandon(interrupted());
  else if (inFlight) interruptPending = true;
});
// A throw in a timer or an unhandled rejection must not end the context: report and go on.
process.on('uncaughtException', (e) => stderrWrite(`Uncaught ${inspect(e)}\n`));
process.on('unhandledRejection', (e) => stderrWrite(`Unhandled rejection: ${inspect(e)}\n`));

function rewrite(code) {
  return code
    .replace(/^(?:let|const)(?=\s)/gm, 'var')
    .replace(/^class\s+([A-Za-z_$][\w$]*)/gm, 'var $1 = class $1');
}

function compile(code, filename) {
  try {
    return { script: new vm.Script(code, { filename }), isAsync: false };
  } catch (e) {
    if (!(e instanceof SyntaxError) || !processTopLevelAwait || !code.includes('await')) throw e;
    let wrapped = null;
    try {
      wrapped = processTopLevelAwait(code);
    } catch (_) {
      // not valid as an async body either: report the original error
    }
    if (wrapped === null) throw e;
    return { script: new vm.Script(wrapped, { filename }), isAsync: true };
  }
}

function trimStack(stack) {
  return stack
    .split('\n')
    .filter((line) => !(/^\s+at /.test(line) && (line.includes(__filename) || /node:/.test(line))))
    .join('\n');
}

function describe(e) {
  if (e !== null && typeof e === 'object' && typeof e.stack === 'string') {
    const message = e.message === undefined ? '' : String(e.message);
    return { name: String(e.name || 'Error'), value: message, traceback: trimStack(e.stack) };
  }
  return { name: 'Error', value: typeof e === 'string' ? e : inspect(e), traceback: '' };
}

function applyEnv(envs) {
  const saved = {};
  for (const [k, v] of Object.entries(envs || {})) {
    saved[k] = Object.prototype.hasOwnProperty.call(process.env, k) ? process.env[k] : undefined;
    process.env[k] = v;
  }
  return () => {
    for (const [k, v] of Object.entries(saved)) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
  };
}

async function execute(req) {
  const filename = `<cell-${++cellNo}>`;
  let restore = () => {};
  try {
    restore = applyEnv(req.envs);
    const { script, isAsync } = compile(rewrite(req.code), filename);
    if (interruptPending) throw interrupted();
    let value = script.runInThisContext({ breakOnSigint: true });
    if (isAsync) {
      const promise = value;
      const wrapped = await new Promise((resolve, reject) => {
        abandon = reject;
        promise.then(resolve, reject);
      });
      value = wrapped ? wrapped.value : undefined; // the rewriter returns { value: last }
    }
    if (value !== undefined) {
      send({ event: 'result', result: { text: inspect(value), is_main_result: true } });
    }
  } catch (e) {
    send({ event: 'error', error: describe(e) });
  } finally {
    abandon = null;
    inFlight -= 1;
    interruptPending = false;
    restore();
    stdoutWrite(`${req.marker}\n`);
    stderrWrite(`${req.marker}\n`);
    send({ event: 'done' });
  }
}

let buffered = '';
let queue = Promise.resolve();
chan.setEncoding('utf8');
chan.on('data', (chunk) => {
  buffered += chunk;
  let nl;
  while ((nl = buffered.indexOf('\n')) >= 0) {
    const req = parse(buffered.slice(0, nl));
    buffered = buffered.slice(nl + 1);
    if (req.op === 'env') queue = queue.then(() => Object.assign(process.env, req.envs));
    else {
      inFlight += 1;
      queue = queue.then(() => execute(req));
    }
  }
});
// The code host is gone: so are we.
chan.on('end', () => process.exit(0));
chan.on('error', () => process.exit(0));
send({ event: 'ready' });
