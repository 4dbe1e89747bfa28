// Run by test_e2b.py under node, with the stock `e2b` package from npm, pointed at an agentbox
// server by E2B's environment variables only:
//
//     node e2b_npm_client.mjs SCENARIO
//
// Like e2b_client.py: one `ok <step>` line per step passed, a non-zero exit on the first
// failure (with the SDK's own error).

import assert from 'node:assert/strict'
import { CommandExitError, Sandbox } from 'e2b'

const TEMPLATE = process.env.E2B_TEST_TEMPLATE || 'host'
const ok = (step) => console.log(`ok ${step}`)
const sleep = (ms) => new Promise((done) => setTimeout(done, ms))

async function until(what, check, ms = 10_000) {
  const deadline = Date.now() + ms
  while (!(await check())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`)
    await sleep(100)
  }
}

async function lifecycle() {
  const sbx = await Sandbox.create(TEMPLATE, {
    timeoutMs: 60_000,
    metadata: { suite: 'npm' },
    envs: { GREETING: 'hi' },
  })
  try {
    assert.ok(sbx.sandboxId.startsWith('sbx_'), sbx.sandboxId)
    assert.equal(await sbx.isRunning(), true)
    const info = await sbx.getInfo()
    assert.equal(info.sandboxId, sbx.sandboxId)
    assert.deepEqual(info.metadata, { suite: 'npm' })
    assert.equal(info.state, 'running')
    ok('create')

    await sbx.setTimeout(300_000)
    const left = (new Date((await sbx.getInfo()).endAt) - Date.now()) / 1000
    assert.ok(left > 290 && left <= 301, `${left}`)
    const listed = await Sandbox.list({ query: { metadata: { suite: 'npm' } } }).nextItems()
    assert.deepEqual(listed.map((s) => s.sandboxId), [sbx.sandboxId])
    ok('timeout_list')

    await sbx.pause()
    assert.equal((await sbx.getInfo()).state, 'paused')
    assert.equal(await sbx.isRunning(), false)
    const back = await Sandbox.connect(sbx.sandboxId)
    assert.equal(await back.isRunning(), true)
    assert.equal((await back.commands.run('echo $GREETING')).stdout, 'hi\n')
    ok('pause_connect')
  } finally {
    await sbx.kill()
  }
  assert.equal(await sbx.isRunning(), false)
  ok('kill')
}

async function commands() {
  const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 120_000 })
  try {
    const seen = []
    const r = await sbx.commands.run('echo out; echo err >&2; echo $X; pwd', {
      envs: { X: 'from-npm' },
      cwd: '/tmp',
      onStdout: (line) => seen.push(line),
    })
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, 'out\nfrom-npm\n/tmp\n')
    assert.equal(r.stderr, 'err\n')
    assert.ok(seen.join('').includes('out'), seen)
    ok('run')

    await assert.rejects(sbx.commands.run('exit 3'), (e) => e instanceof CommandExitError && e.exitCode === 3)
    ok('exit_code')

    const bg = await sbx.commands.run('read line; echo "got $line"', { background: true, stdin: true })
    await sbx.commands.sendStdin(bg.pid, 'hello\n')
    const done = await bg.wait()
    assert.equal(done.stdout, 'got hello\n')
    const sleeper = await sbx.commands.run('sleep 60', { background: true })
    assert.ok((await sbx.commands.list()).some((p) => p.pid === sleeper.pid))
    assert.equal(await sbx.commands.kill(sleeper.pid), true)
    ok('background_stdin_kill')

    let typed = ''
    const term = await sbx.pty.create({
      cols: 100,
      rows: 30,
      onData: (data) => { typed += new TextDecoder().decode(data) },
    })
    await sbx.pty.sendInput(term.pid, new TextEncoder().encode('stty size; tty\n'))
    await until('the terminal to answer', () => typed.includes('30 100') && typed.includes('/dev/pts/'))
    await sbx.pty.resize(term.pid, { cols: 120, rows: 40 })
    await sbx.pty.sendInput(term.pid, new TextEncoder().encode('stty size\n'))
    await until('the resized terminal to answer', () => typed.includes('40 120'))
    await sbx.pty.kill(term.pid)
    ok('pty')
  } finally {
    await sbx.kill()
  }
}

async function files() {
  const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 120_000 })
  try {
    await sbx.files.write('/tmp/npm/hello.txt', 'hello npm')
    assert.equal(await sbx.files.read('/tmp/npm/hello.txt'), 'hello npm')
    const bytes = new Uint8Array(300_000).map((_, i) => i % 251)
    await sbx.files.write('/tmp/npm/blob.bin', bytes)
    assert.deepEqual(await sbx.files.read('/tmp/npm/blob.bin', { format: 'bytes' }), bytes)
    ok('write_read')

    await sbx.files.makeDir('/tmp/npm/sub')
    const names = (await sbx.files.list('/tmp/npm')).map((e) => e.name).sort()
    assert.deepEqual(names, ['blob.bin', 'hello.txt', 'sub'])
    assert.equal(await sbx.files.exists('/tmp/npm/hello.txt'), true)
    await sbx.files.rename('/tmp/npm/hello.txt', '/tmp/npm/sub/moved.txt')
    await sbx.files.remove('/tmp/npm/blob.bin')
    assert.equal(await sbx.files.exists('/tmp/npm/blob.bin'), false)
    assert.equal(await sbx.files.read('/tmp/npm/sub/moved.txt'), 'hello npm')
    ok('filesystem')

    const events = []
    const watch = await sbx.files.watchDir('/tmp/npm', (e) => { events.push(e) }, { recursive: true })
    await sbx.files.write('/tmp/npm/sub/new.txt', 'new')
    await until('a watch event', () => events.some((e) => e.name === 'sub/new.txt'))
    await watch.stop()
    ok('watch')

    const url = await sbx.downloadUrl('/tmp/npm/sub/moved.txt')
    const got = await fetch(url)
    assert.equal(got.status, 200)
    assert.equal(await got.text(), 'hello npm')
    const forged = await fetch(url.replace('moved.txt', 'new.txt'))
    assert.equal(forged.status, 401)
    ok('signed_url')
  } finally {
    await sbx.kill()
  }
}

const scenarios = { lifecycle, commands, files }
await scenarios[process.argv[2]]()
