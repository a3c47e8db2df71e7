// The chat page: conversations kept in localStorage, answers streamed from
// /v1/chat/completions, a stop button that aborts the request (the server
// then aborts it on the engine), regenerate, edit and resend.

import { apiKey, getJson, postJson, setApiKey, sseEvents } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import { showStatus } from "./status.js";
import { setUpTools } from "./tools.js";

const STORE = "pagoda.conversations";
const SETTINGS = "pagoda.settings";
const CURRENT = "pagoda.current";
const $ = (id) => document.getElementById(id);

let conversations = load(STORE, []);
let settings = load(SETTINGS, {});
let current = localStorage.getItem(CURRENT) || null;
if (!conversations.some((c) => c.id === current)) current = conversations[0]?.id || null;
let controller = null;

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversations));
  if (current) localStorage.setItem(CURRENT, current);
  else localStorage.removeItem(CURRENT);
}

function conversation() {
  return conversations.find((c) => c.id === current) || null;
}

function newConversation() {
  const c = { id: crypto.randomUUID(), title: "New chat", messages: [] };
  conversations.unshift(c);
  current = c.id;
  save();
  renderAll();
  return c;
}

function showError(error) {
  const box = $("error");
  box.textContent = error ? String(error.message || error) : "";
  box.hidden = !error;
}

// ---- settings ----

const FIELDS = {
  "system-prompt": "system",
  temperature: "temperature",
  "top-p": "top_p",
  "max-tokens": "max_tokens",
  seed: "seed",
};

function readSettings() {
  for (const [id, name] of Object.entries(FIELDS)) settings[name] = $(id).value;
  settings.model = $("model").value;
  localStorage.setItem(SETTINGS, JSON.stringify(settings));
}

function samplingBody() {
  const body = {
    model: $("model").value,
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  return body;
}

async function loadModels() {
  try {
    const models = (await getJson("/v1/models")).data;
    const select = $("model");
    select.replaceChildren(
      ...models.map((m) => {
        const option = document.createElement("option");
        option.value = option.textContent = m.id;
        return option;
      }),
    );
    if (models.some((m) => m.id === settings.model)) select.value = settings.model;
    showError(null);
  } catch (error) {
    showError(error);
  }
}

async function loadFeatures() {
  try {
    const { tasks } = await getJson("/ui/features");
    $("tab-embed").hidden = !tasks.includes("embed");
    $("tab-transcribe").hidden = !tasks.includes("transcription");
    $("tab-chat").hidden = !tasks.includes("generate");
    // Open the first view the server serves if the one shown is not.
    if (document.querySelector(".tab.active")?.hidden) {
      showView(document.querySelector(".tab:not([hidden])").dataset.view);
    }
  } catch (error) {
    showError(error);
  }
}

// ---- rendering ----

function renderConversations() {
  $("conversations").replaceChildren(
    ...conversations.map((c) => {
      const item = document.createElement("li");
      const title = document.createElement("span");
      title.textContent = c.title;
      item.append(title);
      item.className = c.id === current ? "active" : "";
      item.addEventListener("click", () => {
        current = c.id;
        save();
        renderAll();
      });
      const remove = document.createElement("button");
      remove.className = "remove";
      remove.textContent = "×";
      remove.title = "Delete";
      remove.addEventListener("click", (event) => {
        event.stopPropagation();
        conversations = conversations.filter((x) => x.id !== c.id);
        if (current === c.id) current = conversations[0]?.id || null;
        save();
        renderAll();
      });
      item.append(remove);
      return item;
    }),
  );
}

function statsLine(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.ttft_ms !== undefined) parts.push(`TTFT ${stats.ttft_ms.toFixed(0)} ms`);
  if (stats.tokens_per_s !== undefined) parts.push(`${stats.tokens_per_s.toFixed(1)} tokens/s`);
  if (stats.tokens !== undefined) parts.push(`${stats.tokens} tokens`);
  if (stats.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function renderMessage(message, index, isLast) {
  const box = document.createElement("div");
  box.className = "msg " + message.role;
  const content = document.createElement("div");
  content.className = "content";
  if (message.role === "assistant") content.append(renderMarkdown(message.content));
  else content.textContent = message.content; // the user's own text, shown as typed
  box.append(content);
  const footer = document.createElement("div");
  footer.className = "footer";
  const stats = document.createElement("span");
  stats.className = "stats";
  stats.textContent = statsLine(message.stats);
  footer.append(stats);
  if (!controller) {
    if (message.role === "user") footer.append(button("Edit", "edit", () => editMessage(index, box)));
    if (message.role === "assistant" && isLast) footer.append(button("Regenerate", "regenerate", regenerate));
  }
  box.append(footer);
  return box;
}

function button(label, className, onClick) {
  const b = document.createElement("button");
  b.textContent = label;
  b.className = className;
  b.addEventListener("click", onClick);
  return b;
}

function renderMessages() {
  const c = conversation();
  const messages = c ? c.messages : [];
  $("messages").replaceChildren(...messages.map((m, k) => renderMessage(m, k, k === messages.length - 1)));
  $("messages").scrollTop = $("messages").scrollHeight;
}

function renderAll() {
  renderConversations();
  renderMessages();
  $("send").hidden = !!controller;
  $("stop").hidden = !controller;
}

// ---- generation ----

function requestMessages(c) {
  const system = $("system-prompt").value.trim();
  const messages = c.messages.map(({ role, content }) => ({ role, content }));
  return system ? [{ role: "system", content: system }, ...messages] : messages;
}

async function generate(c) {
  readSettings();
  showError(null);
  const answer = { role: "assistant", content: "", stats: {} };
  const body = {
    ...samplingBody(),
    messages: requestMessages(c),
    stream: true,
    stream_options: { include_usage: true },
  };
  c.messages.push(answer);
  controller = new AbortController();
  save();
  renderAll();
  const started = performance.now();
  let first = null;
  let chunks = 0;
  let pending = false;
  const node = $("messages").lastElementChild;
  const redraw = () => {
    pending = false;
    node.querySelector(".content").replaceChildren(renderMarkdown(answer.content));
    $("messages").scrollTop = $("messages").scrollHeight;
  };
  try {
    const response = await postJson("/v1/chat/completions", body, controller.signal);
    for await (const event of sseEvents(response)) {
      const delta = event.choices?.[0]?.delta?.content;
      if (delta) {
        if (first === null) first = performance.now();
        answer.content += delta;
        chunks++;
        if (!pending) {
          pending = true;
          requestAnimationFrame(redraw);
        }
      }
      if (event.usage) answer.stats.tokens = event.usage.completion_tokens;
    }
  } catch (error) {
    if (error.name === "AbortError") answer.stats.stopped = true;
    else showError(error);
  }
  const ended = performance.now();
  answer.stats.tokens ??= chunks;
  if (first !== null) {
    answer.stats.ttft_ms = first - started;
    const decoding = (ended - first) / 1000;
    if (decoding > 0 && answer.stats.tokens > 1) answer.stats.tokens_per_s = (answer.stats.tokens - 1) / decoding;
  }
  controller = null;
  save();
  renderAll();
}

function send() {
  const text = $("prompt").value;
  if (!text.trim() || controller) return;
  const c = conversation() || newConversation();
  if (!c.messages.length) c.title = text.slice(0, 40);
  c.messages.push({ role: "user", content: text });
  $("prompt").value = "";
  generate(c);
}

function regenerate() {
  const c = conversation();
  if (!c || controller) return;
  if (c.messages.at(-1)?.role === "assistant") c.messages.pop();
  generate(c);
}

function editMessage(index, box) {
  const c = conversation();
  const area = document.createElement("textarea");
  area.value = c.messages[index].content;
  area.rows = 3;
  const resend = button("Send", "primary resend", () => {
    c.messages = c.messages.slice(0, index);
    c.messages.push({ role: "user", content: area.value });
    generate(c);
  });
  box.replaceChildren(area, resend, button("Cancel", "cancel", renderMessages));
  area.focus();
}

// ---- import / export ----

function exportConversations() {
  const blob = new Blob([JSON.stringify(conversations, null, 2)], { type: "application/json" });
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = "pagoda-conversations.json";
  link.click();
  URL.revokeObjectURL(link.href);
}

// Keeps only the fields the page uses, as strings: an import is data, never markup.
function cleanConversation(raw) {
  if (!raw || !Array.isArray(raw.messages)) throw new Error("a conversation needs a messages list");
  return {
    id: crypto.randomUUID(),
    title: String(raw.title ?? "Imported chat").slice(0, 80),
    messages: raw.messages
      .filter((m) => m && ["user", "assistant"].includes(m.role))
      .map((m) => ({ role: m.role, content: String(m.content ?? "") })),
  };
}

async function importConversations(file) {
  try {
    const parsed = JSON.parse(await file.text());
    const imported = (Array.isArray(parsed) ? parsed : [parsed]).map(cleanConversation);
    conversations = [...imported, ...conversations];
    current = imported[0]?.id ?? current;
    save();
    renderAll();
    showError(null);
  } catch (error) {
    showError(new Error("could not import: " + (error.message || error)));
  }
}

// ---- views and theme ----

function showView(name) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.view === name);
  for (const view of document.querySelectorAll(".view")) view.hidden = view.id !== "view-" + name;
  showStatus(name === "status");
}

function applyTheme(theme) {
  document.documentElement.dataset.theme = theme;
  settings.theme = theme;
  localStorage.setItem(SETTINGS, JSON.stringify(settings));
}

function start() {
  const dark = window.matchMedia?.("(prefers-color-scheme: dark)").matches;
  if (window.matchMedia?.("(max-width: 700px)").matches) $("settings").open = false; // room for the chat
  applyTheme(settings.theme || (dark ? "dark" : "light"));
  for (const [id, name] of Object.entries(FIELDS)) if (settings[name] !== undefined) $(id).value = settings[name];
  $("api-key").value = apiKey();
  $("api-key").addEventListener("change", () => {
    setApiKey($("api-key").value.trim());
    loadModels();
    loadFeatures();
  });
  for (const id of Object.keys(FIELDS)) $(id).addEventListener("change", readSettings);
  $("model").addEventListener("change", readSettings);
  $("send").addEventListener("click", send);
  $("stop").addEventListener("click", () => controller?.abort());
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      send();
    }
  });
  $("new-chat").addEventListener("click", newConversation);
  $("export").addEventListener("click", exportConversations);
  $("import-file").addEventListener("change", (event) => {
    const file = event.target.files[0];
    if (file) importConversations(file);
    event.target.value = "";
  });
  $("theme").addEventListener("click", () =>
    applyTheme(document.documentElement.dataset.theme === "dark" ? "light" : "dark"),
  );
  for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => showView(tab.dataset.view));
  setUpTools(() => $("model").value, showError);
  renderAll();
  loadModels();
  loadFeatures();
  document.body.dataset.ready = "true";
}

start();
