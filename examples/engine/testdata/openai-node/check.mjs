// The official OpenAI Node client against the reference engine: model
// list, completions and chat completions, streamed and not, with the
// cached tokens a second request over a shared prefix must report, and
// OpenAI's errors as the client parses them. Run by
// .ci/steps/72-openai-node.sh with ENGINE_URL set to the engine's
// http://HOST:PORT; exits non-zero at the first mismatch.
import OpenAI from 'openai';

const base = process.env.ENGINE_URL;
if (!base) {
  console.error('ENGINE_URL is not set');
  process.exit(2);
}
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 20000 });

let checks = 0;
function check(cond, what, got) {
  checks++;
  if (!cond) {
    console.error(`FAIL ${what}: ${JSON.stringify(got)}`);
    process.exit(1);
  }
}
const words = (s) => s.trim().split(/\s+/).filter((w) => w !== '').length;

// A prompt of 40 words: two full blocks of 16 tokens are shared by the
// second request, so it reports 32 cached tokens.
const shared = Array.from({ length: 40 }, (_, i) => `w${100 + i}`).join(' ');

const models = await client.models.list();
const ids = models.data.map((m) => m.id);
check(ids.includes('sim-1'), 'models.list has sim-1', ids);

// Completions, not streamed, then streamed with usage.
const c1 = await client.completions.create({ model: 'sim-1', prompt: shared, max_tokens: 4, ignore_eos: true });
check(c1.object === 'text_completion' && c1.choices.length === 1 && words(c1.choices[0].text) === 4, 'completion text', c1);
check(c1.choices[0].finish_reason === 'length', 'completion finish_reason', c1.choices[0]);
check(c1.usage.prompt_tokens === 40 && c1.usage.completion_tokens === 4, 'completion usage', c1.usage);
check(c1.usage.prompt_tokens_details.cached_tokens === 0, 'first completion cached_tokens', c1.usage);

const s1 = await client.completions.create({
  model: 'sim-1', prompt: `${shared} w7 w8`, max_tokens: 5, ignore_eos: true,
  stream: true, stream_options: { include_usage: true },
});
let text = '';
let usage = null;
let finish = null;
for await (const chunk of s1) {
  if (chunk.usage) usage = chunk.usage;
  for (const ch of chunk.choices) {
    text += ch.text;
    if (ch.finish_reason) finish = ch.finish_reason;
  }
}
check(words(text) === 5 && finish === 'length', 'streamed completion', { text, finish });
check(usage && usage.prompt_tokens === 42 && usage.prompt_tokens_details.cached_tokens === 32, 'streamed completion usage', usage);

// Chat completions: a conversation, then another with the same system
// prompt (the template puts it first: its blocks are shared).
const system = Array.from({ length: 40 }, (_, i) => `w${300 + i}`).join(' ');
const chat1 = await client.chat.completions.create({
  model: 'sim-1', max_completion_tokens: 3, ignore_eos: true,
  messages: [{ role: 'system', content: system }, { role: 'user', content: 'first question' }],
});
const m1 = chat1.choices[0].message;
check(chat1.object === 'chat.completion' && m1.role === 'assistant' && words(m1.content) === 3, 'chat message', chat1);
check(chat1.usage.prompt_tokens_details.cached_tokens === 0, 'first chat cached_tokens', chat1.usage);

const chat2 = await client.chat.completions.create({
  model: 'sim-1', max_tokens: 3, ignore_eos: true, stream: true, stream_options: { include_usage: true },
  messages: [{ role: 'system', content: system }, { role: 'user', content: [{ type: 'text', text: 'second question' }] }],
});
let content = '';
let role = null;
usage = null;
finish = null;
for await (const chunk of chat2) {
  if (chunk.usage) usage = chunk.usage;
  for (const ch of chunk.choices) {
    if (ch.delta.role) role = ch.delta.role;
    if (ch.delta.content) content += ch.delta.content;
    if (ch.finish_reason) finish = ch.finish_reason;
  }
}
check(role === 'assistant' && words(content) === 3 && finish === 'length', 'streamed chat', { role, content, finish });
check(usage && usage.prompt_tokens_details.cached_tokens === 32, 'streamed chat cached_tokens', usage);

// The same through the client's stream helper.
const runner = client.chat.completions.stream({
  model: 'sim-1', max_tokens: 2, ignore_eos: true, messages: [{ role: 'user', content: 'hello' }],
});
const final = await runner.finalChatCompletion();
check(words(final.choices[0].message.content) === 2, 'chat stream helper', final);

// Errors as the client parses them.
async function refused(what, fn, status, param, code) {
  try {
    await fn();
  } catch (err) {
    check(err instanceof OpenAI.APIError && err.status === status && err.param === param && err.code === code &&
      err.type !== undefined && typeof err.message === 'string', what, { status: err.status, param: err.param, code: err.code, type: err.type, message: err.message });
    return;
  }
  check(false, `${what}: accepted`, null);
}
await refused('n=2', () => client.chat.completions.create({ model: 'sim-1', n: 2, messages: [{ role: 'user', content: 'x' }] }),
  400, 'n', 'unsupported_parameter');
await refused('echo', () => client.completions.create({ model: 'sim-1', prompt: 'x', echo: true }), 400, 'echo', 'unsupported_parameter');
await refused('unknown model', () => client.chat.completions.create({ model: 'nope', messages: [{ role: 'user', content: 'x' }] }),
  404, 'model', 'model_not_found');
await refused('unknown endpoint', () => client.get('/nope'), 404, null, 'unknown_url');
await refused('context', () => client.completions.create({ model: 'sim-1', prompt: shared, max_tokens: 1000000 }),
  400, 'max_tokens', 'context_length_exceeded');

console.log(`openai-node OK ${checks} checks`);
