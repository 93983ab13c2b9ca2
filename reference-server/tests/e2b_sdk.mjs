// The real E2B JavaScript SDK against the sandspec reference server.
//
// Run by `tests/e2b.rs` with node, E2B_API_URL and E2B_SANDBOX_URL set to the server's base
// URL, E2B_API_KEY to a principal's key, SANDSPEC_NPM_PREFIX to the npm prefix the pinned SDK
// is installed in and SANDSPEC_E2B_DOC to `docs/profiles/e2b.md`. Every call must succeed with
// the SDK's own types; a killed sandbox and a wrong key must surface as the SDK's own errors.
// Every public method of `Sandbox`, `sandbox.files`, `sandbox.commands` and `sandbox.pty` (by
// the SDK's own type declarations: protected and private members are not public) must have a
// row in the doc's SDK method table. Any failed check throws.

import { readFileSync } from 'node:fs'
import { createRequire } from 'node:module'
import { join } from 'node:path'

const prefix = process.env.SANDSPEC_NPM_PREFIX
const require = createRequire(join(prefix, 'node_modules', '.sandspec'))
const { Sandbox, AuthenticationError, NotFoundError, SandboxNotFoundError, CommandExitError, FileType } =
  require('e2b')

function check(condition, what) {
  if (!condition) throw new Error(`check failed: ${what}`)
  console.log(`ok: ${what}`)
}

async function rejects(promise, isExpected, what) {
  try {
    await promise
  } catch (e) {
    check(isExpected(e), `${what} (got ${e?.constructor?.name}: ${e?.message})`)
    return
  }
  throw new Error(`check failed: ${what} (no error)`)
}

// The public methods each class declares, from the SDK's own declarations (the runtime cannot
// tell a TypeScript `protected` member from a public one).
const declarations = readFileSync(join(prefix, 'node_modules', 'e2b', 'dist', 'index.d.ts'), 'utf8')
function declared(cls) {
  const start = declarations.indexOf(`\ndeclare class ${cls} `)
  if (start < 0) throw new Error(`no declaration of ${cls}`)
  const end = declarations.indexOf('\n}', start)
  const names = new Set()
  for (const line of declarations.slice(start, end).split('\n')) {
    const m = line.match(/^ {2}(static )?([a-zA-Z]+)(<[^(]*>)?\(/)
    if (m && m[2] !== 'constructor') names.add(m[2])
  }
  return names
}

function tableRows(docPath) {
  const text = readFileSync(docPath, 'utf8')
  const section = text.split('\n## SDK methods\n')[1].split('\n## ')[0]
  const rows = {}
  for (const line of section.split('\n')) {
    const cells = line.trim().replace(/^\||\|$/g, '').split('|').map((c) => c.trim())
    if (cells.length < 3 || !cells[0].startsWith('`')) continue
    const cls = cells[0].replaceAll('`', '')
    rows[cls] ??= new Set()
    for (const m of cells[2].matchAll(/`([a-zA-Z]+)`/g)) rows[cls].add(m[1])
  }
  return rows
}

const rows = tableRows(process.env.SANDSPEC_E2B_DOC)
const classes = [
  ['Sandbox', new Set([...declared('Sandbox'), ...declared('SandboxApi')])],
  ['files', declared('Filesystem')],
  ['commands', declared('Commands')],
  ['pty', declared('Pty')],
]
for (const [label, names] of classes) {
  const missing = [...names].filter((n) => !rows[label]?.has(n)).sort()
  check(missing.length === 0, `every public method of ${label} has a row in the SDK method table (missing: ${missing})`)
}

const runId = `${Date.now()}-${Math.random().toString(16).slice(2)}`
const sbx = await Sandbox.create({ timeoutMs: 120_000, metadata: { run: runId }, envs: { GREETING: 'hello' } })
check(sbx.sandboxId, 'Sandbox.create returns a sandbox')
const info = await sbx.getInfo()
check(info.sandboxId === sbx.sandboxId && info.metadata.run === runId && info.state === 'running', 'getInfo')
check(await sbx.isRunning(), 'isRunning')

// Commands.
const result = await sbx.commands.run('echo "$GREETING $ONLY_HERE"; echo oops >&2', { envs: { ONLY_HERE: 'scoped' } })
check(result.exitCode === 0 && result.stdout === 'hello scoped\n' && result.stderr === 'oops\n', 'commands.run with envs')
await rejects(sbx.commands.run('exit 3'), (e) => e instanceof CommandExitError && e.exitCode === 3, 'a failing command throws CommandExitError')
const cat = await sbx.commands.run('cat', { background: true, stdin: true })
check((await sbx.commands.list()).some((p) => p.pid === cat.pid), 'commands.list shows the background command')
const attached = await sbx.commands.connect(cat.pid)
await sbx.commands.sendStdin(cat.pid, 'ping\n')
await sbx.commands.closeStdin(cat.pid)
const done = await cat.wait()
check(done.exitCode === 0 && done.stdout === 'ping\n', 'sendStdin and closeStdin reach the background command')
check((await attached.wait()).exitCode === 0, 'commands.connect sees the same end')
const sleeper = await sbx.commands.run('sleep 600', { background: true })
check((await sbx.commands.kill(sleeper.pid)) === true, 'commands.kill')
await rejects(sleeper.wait(), (e) => e instanceof CommandExitError, 'a killed command ends with CommandExitError')
check((await sbx.commands.kill(sleeper.pid)) === false, 'killing it again reports not found')

// Files.
await sbx.files.makeDir('notes')
check((await sbx.files.makeDir('notes')) === false, 'files.makeDir reports an existing directory')
const written = await sbx.files.write('notes/a.txt', 'hello file', { metadata: { author: 'sandspec' } })
check(written.path === '/home/user/notes/a.txt', 'files.write')
const blob = new Uint8Array(4096).map((_, i) => i % 256)
await sbx.files.write('bin.dat', blob.buffer)
const back = await sbx.files.read('bin.dat', { format: 'bytes' })
check(back.length === blob.length && back.every((b, i) => b === blob[i]), 'binary bytes round-trip')
check((await sbx.files.read('notes/a.txt', { gzip: true })) === 'hello file', 'files.read with gzip')
const entry = await sbx.files.getInfo('notes/a.txt')
check(entry.type === FileType.FILE && entry.mode === 0o644 && entry.metadata?.author === 'sandspec', 'files.getInfo: mode and metadata')
await sbx.files.writeFiles([{ path: 'multi/x.txt', data: 'X' }, { path: 'multi/y/z.txt', data: 'Z' }])
const deep = (await sbx.files.list('multi', { depth: 2 })).map((e) => e.path)
check(JSON.stringify(deep) === JSON.stringify(['/home/user/multi/x.txt', '/home/user/multi/y', '/home/user/multi/y/z.txt']), 'files.list with depth')
check((await sbx.files.exists('notes/a.txt')) && !(await sbx.files.exists('nope.txt')), 'files.exists')
const moved = await sbx.files.rename('notes/a.txt', 'notes/b.txt')
check(moved.path === '/home/user/notes/b.txt', 'files.rename')
await sbx.files.remove('notes/b.txt')
await sbx.files.remove('notes/never-there.txt')
check(!(await sbx.files.exists('notes/b.txt')), 'files.remove, also of a missing path')
const seen = []
const watcher = await sbx.files.watchDir('notes', (event) => seen.push(event), { recursive: true })
await sbx.files.write('notes/deep/seen.txt', 'x')
for (let i = 0; i < 100 && !seen.some((e) => e.name === 'deep/seen.txt'); i++) await new Promise((r) => setTimeout(r, 100))
check(seen.some((e) => e.name === 'deep/seen.txt'), 'files.watchDir reports a file below a new directory')
await watcher.stop()

// PTY.
let screen = ''
const term = await sbx.pty.create({ rows: 24, cols: 80, onData: (d) => { screen += new TextDecoder().decode(d) } })
await sbx.pty.resize(term.pid, { rows: 30, cols: 100 })
await sbx.pty.sendInput(term.pid, new TextEncoder().encode('stty size; exit\n'))
const ended = await term.wait()
check(ended.exitCode === 0 && screen.includes('30 100'), 'pty.create, resize and sendInput on a real terminal')
const term2 = await sbx.pty.create({ rows: 24, cols: 80, onData: () => {} })
check((await sbx.pty.kill(term2.pid)) === true, 'pty.kill')
const term3 = await sbx.pty.create({ rows: 24, cols: 80, onData: () => {} })
const again = await sbx.pty.connect(term3.pid, { onData: () => {} })
await sbx.pty.kill(term3.pid)
await rejects(again.wait(), (e) => e instanceof CommandExitError, 'pty.connect sees the killed terminal end')

// Signed URLs: E2B_SANDBOX_URL routes by headers, so the request carries them.
const routed = { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '49983' }
await sbx.files.write('signed.txt', 'signed content')
const signed = await fetch(await sbx.downloadUrl('signed.txt', { useSignatureExpiration: 60_000 }), { headers: routed })
check(signed.status === 200 && (await signed.text()) === 'signed content', 'downloadUrl is signed with the access token')

// Snapshots, forks, metrics, list order, timeout, pause and connect.
const snap = await sbx.createSnapshot()
check((await Sandbox.listSnapshots({ sandboxId: sbx.sandboxId }).nextItems()).some((s) => s.snapshotId === snap.snapshotId), 'createSnapshot and listSnapshots')
const restored = await Sandbox.create(snap.snapshotId, { timeoutMs: 120_000, metadata: { run: runId } })
check((await restored.files.read('signed.txt')) === 'signed content', 'a sandbox from a snapshot has its files')
check((await Sandbox.deleteSnapshot(snap.snapshotId)) === true && (await Sandbox.deleteSnapshot(snap.snapshotId)) === false, 'deleteSnapshot')
const forks = await sbx.fork({ count: 2, timeoutMs: 120_000 })
check(forks.length === 2 && forks.every((f) => f instanceof Sandbox), 'fork with count 2')
const metrics = await sbx.getMetrics()
check(metrics.length === 1 && metrics[0].cpuCount >= 1, 'getMetrics')
const newest = await Sandbox.list({ query: { metadata: { run: runId } } }).nextItems()
const oldest = await Sandbox.list({ query: { metadata: { run: runId } }, order: 'asc' }).nextItems()
check(newest.length === 4 && newest.map((s) => s.sandboxId).join() === oldest.map((s) => s.sandboxId).reverse().join(), 'list orders newest first, or oldest first')
try {
  await sbx.updateNetwork({ denyOut: ['8.8.8.8'] })
  check(true, 'updateNetwork takes a denial')
} catch (e) {
  check(/host's network/.test(e.message), 'updateNetwork: nothing can be denied without a network namespace')
}
await rejects(sbx.updateNetwork({ allowOut: ['1.1.1.1'] }), (e) => /cannot be honoured/.test(e.message), 'updateNetwork refuses an allowance')
await sbx.setTimeout(300_000)
check((await Sandbox.getFullInfo(sbx.sandboxId)).sandboxId === sbx.sandboxId, 'Sandbox.getFullInfo')
check((await restored.pause()) === true, 'pause')
check((await Sandbox.getInfo(restored.sandboxId)).state === 'paused', 'a paused sandbox reports paused')
const resumed = await Sandbox.connect(restored.sandboxId)
check((await resumed.files.read('signed.txt')) === 'signed content', 'connect resumes a paused sandbox with its files')
check((await resumed.betaPause()) === true, 'betaPause')
for (const other of [restored, ...forks]) await other.kill()

check((await sbx.kill()) === true, 'kill')
check((await Sandbox.kill(sbx.sandboxId)) === false, 'a second kill reports not found')
await rejects(Sandbox.connect(sbx.sandboxId), (e) => e instanceof SandboxNotFoundError || e instanceof NotFoundError, 'connect after kill is not found')
await rejects(Sandbox.create({ apiKey: 'e2b_00000000000000000000000000000000deadbeef' }), (e) => e instanceof AuthenticationError, 'a wrong key is an AuthenticationError')

console.log('e2b js sdk: all checks passed')
