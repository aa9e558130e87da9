// The chat playground: conversations kept in localStorage, replies streamed over SSE.
import { api, errorMessage } from "/static/api.js";

const STORE = "pagellm.conversations";
const SETTINGS = "pagellm.settings";
const FIELDS = ["system", "temperature", "top_p", "top_k", "max_tokens", "seed"];
const $ = (id) => document.getElementById(id);

let conversations = JSON.parse(localStorage.getItem(STORE) || "[]");
let current = null;
let controller = null;

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversations));
}

function newConversation() {
  current = { id: crypto.randomUUID ? crypto.randomUUID() : String(Date.now()),
              title: "New chat", messages: [] };
  conversations.unshift(current);
  save();
  render();
}

function renderList() {
  const list = $("conversation-list");
  list.replaceChildren();
  for (const conversation of conversations) {
    const item = document.createElement("li");
    item.classList.toggle("current", conversation === current);
    const link = document.createElement("a");
    link.textContent = conversation.title;
    link.title = conversation.title;
    link.addEventListener("click", () => { if (!controller) { current = conversation; render(); } });
    const remove = document.createElement("button");
    remove.textContent = "×";
    remove.title = "delete this conversation";
    remove.addEventListener("click", () => {
      if (controller) return;
      conversations = conversations.filter((c) => c !== conversation);
      save();
      if (conversation === current) conversations.length ? (current = conversations[0]) : newConversation();
      render();
    });
    item.append(link, remove);
    list.append(item);
  }
}

function bubble(message) {
  const element = document.createElement("div");
  element.className = `message ${message.role}`;
  element.textContent = message.content;
  if (message.meta) appendMeta(element, message.meta);
  $("messages").append(element);
  return element;
}

function appendMeta(element, text) {
  const meta = document.createElement("span");
  meta.className = "meta";
  meta.textContent = text;
  element.append(meta);
}

function render() {
  renderList();
  $("messages").replaceChildren();
  current.messages.forEach(bubble);
  $("messages").scrollTop = $("messages").scrollHeight;
}

function samplingSettings() {
  const number = (id) => ($(id).value === "" ? null : Number($(id).value));
  const body = { temperature: number("temperature"), top_p: number("top_p"),
                 max_tokens: number("max_tokens") };
  if (number("top_k")) body.top_k = number("top_k");
  if (number("seed") !== null) body.seed = number("seed");
  return body;
}

// Each SSE event's JSON, as the stream's bytes arrive.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

async function streamReply(messages, reply, element) {
  const started = performance.now();
  const response = await api("/v1/chat/completions", {
    method: "POST", signal: controller.signal, headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ model: $("model").value, messages, stream: true,
                           stream_options: { include_usage: true }, ...samplingSettings() }),
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  let usage = null;
  for await (const chunk of events(response)) {
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) usage = chunk.usage;
    const delta = chunk.choices?.[0]?.delta?.content;
    if (delta) {
      reply.content += delta;
      element.textContent = reply.content;
      $("messages").scrollTop = $("messages").scrollHeight;
    }
  }
  const seconds = (performance.now() - started) / 1000;
  if (usage) {
    reply.meta = `${usage.completion_tokens} tokens in ${seconds.toFixed(1)} s ` +
                 `(${(usage.completion_tokens / seconds).toFixed(1)} tokens/s)`;
  }
}

async function send(text) {
  if (!text.trim() || controller) return;
  const user = { role: "user", content: text };
  current.messages.push(user);
  if (current.title === "New chat") current.title = text.slice(0, 40);
  save();
  renderList();
  bubble(user);
  const system = $("system").value.trim();
  const history = current.messages.map(({ role, content }) => ({ role, content }));
  const messages = system ? [{ role: "system", content: system }, ...history] : history;
  const reply = { role: "assistant", content: "" };
  current.messages.push(reply);
  const element = bubble(reply);
  element.classList.add("streaming");
  controller = new AbortController();
  $("send").hidden = true;
  $("stop").hidden = false;
  try {
    await streamReply(messages, reply, element);
  } catch (error) {
    reply.meta = error.name === "AbortError" ? "stopped" : `error: ${error.message}`;
  } finally {
    controller = null;
    element.classList.remove("streaming");
    element.textContent = reply.content;
    if (reply.meta) appendMeta(element, reply.meta);
    $("send").hidden = false;
    $("stop").hidden = true;
    save();
  }
}

async function loadModels() {
  const select = $("model");
  try {
    const response = await api("/v1/models");
    if (!response.ok) throw new Error(await errorMessage(response));
    const models = (await response.json()).data;
    const previous = JSON.parse(localStorage.getItem(SETTINGS) || "{}").model;
    select.replaceChildren(...models.map((m) => new Option(m.id, m.id)));
    if (models.some((m) => m.id === previous)) select.value = previous;
    $("server-note").textContent = `context ${models[0].max_model_len} tokens`;
  } catch (error) {
    $("server-note").textContent = `models: ${error.message}`;
  }
}

function keepSettings() {
  const stored = JSON.parse(localStorage.getItem(SETTINGS) || "{}");
  for (const id of FIELDS) if (id in stored) $(id).value = stored[id];
  const store = () => {
    const values = { model: $("model").value };
    for (const id of FIELDS) values[id] = $(id).value;
    localStorage.setItem(SETTINGS, JSON.stringify(values));
  };
  for (const id of ["model", ...FIELDS]) $(id).addEventListener("change", store);
}

export function startChat() {
  keepSettings();
  loadModels();
  if (conversations.length) { current = conversations[0]; render(); } else newConversation();
  $("new-chat").addEventListener("click", () => { if (!controller) newConversation(); });
  $("stop").addEventListener("click", () => controller?.abort());
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
}
