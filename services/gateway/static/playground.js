// u1serve playground: plain JS over the public API (fetch + SSE), no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const running = {};                       // tab -> AbortController of its request in flight

// ---------------------------------------------------------------------------------------------- plumbing
function headers(json = true) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setStatus(id, text, error = false) {
  const el = $(id);
  el.textContent = text;
  el.classList.toggle("error", error);
}

// The `data:` events of an SSE response until [DONE].
async function* sse(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        try { yield JSON.parse(data); } catch (e) { /* not JSON: ignore */ }
      }
    }
  }
}

async function errorMessage(resp) {
  try {
    const body = await resp.json();
    return (body.error && body.error.message) || resp.statusText;
  } catch (e) {
    return `${resp.status} ${resp.statusText}`;
  }
}

function eventError(ev) {
  return ev && ev.error ? (ev.error.message || "error") : null;
}

function extraJSON(id) {
  const text = $(id).value.trim();
  return text ? JSON.parse(text) : {};
}

function begin(tab) {
  if (running[tab]) running[tab].abort();
  running[tab] = new AbortController();
  return running[tab].signal;
}

function stop(tab, statusId) {
  if (running[tab]) running[tab].abort();
  running[tab] = null;
  setStatus(statusId, "stopped");
}

function number(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
}

function dataURL(b64, format) {
  return `data:image/${format || "png"};base64,${b64}`;
}

function readFiles(files) {
  return Promise.all(Array.from(files).map((f) => new Promise((ok, fail) => {
    const r = new FileReader();
    r.onload = () => ok(r.result);
    r.onerror = () => fail(r.error);
    r.readAsDataURL(f);
  })));
}

async function post(path, body, signal, json = true) {
  return fetch(path, { method: "POST", headers: headers(json), body: json ? JSON.stringify(body) : body, signal });
}

function model() {
  return $("model").value || undefined;
}

// ---------------------------------------------------------------------------------------------- chat
const history = [];

function addMessage(role) {
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  el.innerHTML = `<div class="role">${role}</div>`;
  if (role === "assistant") {
    const think = document.createElement("details");
    think.className = "think";
    think.hidden = true;
    think.innerHTML = "<summary>thinking</summary><pre></pre>";
    el.appendChild(think);
  }
  const content = document.createElement("div");
  content.className = "content";
  el.appendChild(content);
  $("chat-log").appendChild(el);
  return el;
}

async function sendChat() {
  const text = $("chat-input").value.trim();
  if (!text) return;
  let extra;
  try { extra = extraJSON("chat-extra"); } catch (e) { return setStatus("chat-status", "extra JSON: " + e.message, true); }
  history.push({ role: "user", content: text });
  addMessage("user").querySelector(".content").textContent = text;
  $("chat-input").value = "";
  const bubble = addMessage("assistant");
  const content = bubble.querySelector(".content");
  const think = bubble.querySelector(".think");
  const body = { model: model(), messages: history, stream: true, temperature: number("chat-temperature"),
                 max_tokens: number("chat-max-tokens"), stream_options: { include_usage: true }, ...extra };
  const mode = $("chat-think").value;
  if (mode) body.chat_template_kwargs = { enable_thinking: mode === "true" };
  setStatus("chat-status", "waiting ...");
  const signal = begin("chat");
  let finish = null;
  let usage = null;
  try {
    const resp = await post("/v1/chat/completions", body, signal);
    if (!resp.ok) throw new Error(await errorMessage(resp));
    setStatus("chat-status", "streaming ...");
    for await (const ev of sse(resp)) {
      const err = eventError(ev);
      if (err) throw new Error(err);
      if (ev.usage) usage = ev.usage;
      const choice = ev.choices && ev.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if (delta.reasoning_content) {
        think.hidden = false;
        think.querySelector("pre").textContent += delta.reasoning_content;
      }
      if (delta.content) content.textContent += delta.content;
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    history.push({ role: "assistant", content: content.textContent });
    const tokens = usage ? `, ${usage.completion_tokens} tokens` : "";
    setStatus("chat-status", `done (${finish || "?"}${tokens})`);
  } catch (e) {
    if (e.name !== "AbortError") setStatus("chat-status", e.message, true);
  }
}

// ---------------------------------------------------------------------------------------------- images
function imageOptions() {
  const opts = { model: model(), prompt: $("img-prompt").value.trim(), size: $("img-size").value.trim(),
                 num_inference_steps: number("img-steps"), guidance_scale: number("img-guidance"),
                 seed: number("img-seed"), partial_images: Number($("img-partial").value),
                 output_format: $("img-format").value, think: $("img-think").checked, stream: true };
  for (const k of Object.keys(opts)) if (opts[k] === undefined || opts[k] === "") delete opts[k];
  return opts;
}

async function generateImage() {
  const opts = imageOptions();
  if (!opts.prompt) return setStatus("img-status", "a prompt is needed", true);
  const files = $("img-files").files;
  const signal = begin("image");
  $("img-results").innerHTML = "";
  $("img-preview").innerHTML = "";
  $("img-think-text").textContent = "";
  $("img-think-box").hidden = true;
  $("img-progress").value = 0;
  setStatus("img-status", "waiting ...");
  try {
    let resp;
    if (files.length) {
      const form = new FormData();
      for (const [k, v] of Object.entries(opts)) form.append(k, String(v));
      for (const f of files) form.append("image[]", f);
      resp = await post("/v1/images/edits", form, signal, false);
    } else {
      resp = await post("/v1/images/generations", opts, signal);
    }
    if (!resp.ok) throw new Error(await errorMessage(resp));
    let images = 0;
    for await (const ev of sse(resp)) {
      const err = eventError(ev);
      if (err) throw new Error(err);
      const kind = (ev.type || "").split(".").pop();
      if (kind === "think_delta") {
        $("img-think-box").hidden = false;
        $("img-think-box").open = true;
        $("img-think-text").textContent += ev.text;
        setStatus("img-status", "thinking ...");
      } else if (kind === "progress") {
        $("img-progress").max = ev.total;
        $("img-progress").value = ev.step;
        setStatus("img-status", `step ${ev.step} / ${ev.total}`);
      } else if (kind === "partial_image") {
        const img = document.createElement("img");
        img.src = dataURL(ev.b64_json, ev.output_format);
        img.title = `preview ${ev.partial_image_index + 1}`;
        $("img-preview").replaceChildren(img);
      } else if (kind === "completed") {
        images += 1;
        const fig = document.createElement("figure");
        const img = document.createElement("img");
        img.src = ev.url || dataURL(ev.b64_json, ev.output_format);
        fig.appendChild(img);
        const cap = document.createElement("figcaption");
        cap.textContent = `${ev.size}, seed ${ev.seed}`;
        fig.appendChild(cap);
        $("img-results").appendChild(fig);
      }
    }
    setStatus("img-status", `done (${images} image${images === 1 ? "" : "s"})`);
  } catch (e) {
    if (e.name !== "AbortError") setStatus("img-status", e.message, true);
  }
}

// ---------------------------------------------------------------------------------------------- interleaved
async function sendInterleave() {
  const prompt = $("il-prompt").value.trim();
  if (!prompt) return setStatus("il-status", "a prompt is needed", true);
  let extra;
  try { extra = extraJSON("il-extra"); } catch (e) { return setStatus("il-status", "extra JSON: " + e.message, true); }
  const urls = await readFiles($("il-files").files);
  const content = urls.length ? [...urls.map((url) => ({ type: "image_url", image_url: { url } })),
                                 { type: "text", text: prompt }] : prompt;
  const imageConfig = { size: $("il-size").value.trim(), num_inference_steps: number("il-steps"),
                        max_images: number("il-max-images"), partial_images: Number($("il-partial").value),
                        seed: number("il-seed") };
  for (const k of Object.keys(imageConfig)) if (imageConfig[k] === undefined || imageConfig[k] === "") delete imageConfig[k];
  const body = { model: model(), messages: [{ role: "user", content }], modalities: ["text", "image"], stream: true,
                 stream_options: { include_usage: true }, ...extra,
                 image_config: { ...imageConfig, ...(extra.image_config || {}) } };
  if ($("il-think").value === "false") body.chat_template_kwargs = { enable_thinking: false };
  const out = $("il-output");
  const reasoning = $("il-reasoning");
  out.innerHTML = "";
  reasoning.innerHTML = "";
  $("il-think-box").hidden = true;
  const pending = {};                     // image index -> its placeholder (progress + preview)
  let where = out;                        // the part of the answer the model is writing (reasoning or content)
  const signal = begin("interleave");
  setStatus("il-status", "waiting ...");
  let finish = null;
  let images = 0;
  try {
    const resp = await post("/v1/chat/completions", body, signal);
    if (!resp.ok) throw new Error(await errorMessage(resp));
    for await (const ev of sse(resp)) {
      const err = eventError(ev);
      if (err) throw new Error(err);
      const choice = ev.choices && ev.choices[0];
      if (!choice) continue;
      const d = choice.delta || {};
      if (d.reasoning_content) {
        $("il-think-box").hidden = false;
        $("il-think-box").open = true;
        where = reasoning;
        where.appendChild(document.createTextNode(d.reasoning_content));
      }
      if (d.content) {
        where = out;
        where.appendChild(document.createTextNode(d.content));
      }
      if (d.image_progress) {
        const p = d.image_progress;
        if (!pending[p.index]) {
          pending[p.index] = document.createElement("span");
          pending[p.index].className = "pending";
          pending[p.index].innerHTML = "<span></span><img hidden>";
          where.appendChild(pending[p.index]);
        }
        pending[p.index].firstChild.textContent = `image ${p.index + 1}: step ${p.step} / ${p.total}`;
        setStatus("il-status", `image ${p.index + 1}: step ${p.step} / ${p.total}`);
      }
      if (d.partial_image && pending[d.partial_image.index]) {
        const img = pending[d.partial_image.index].querySelector("img");
        img.hidden = false;
        img.src = d.partial_image.image_url.url;
      }
      for (const part of d.images || []) {
        const img = document.createElement("img");
        img.src = part.image_url.url;
        img.className = "generated";
        const slot = pending[part.index];
        if (slot) slot.replaceWith(img); else where.appendChild(img);
        images += 1;
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    setStatus("il-status", `done (${finish || "?"}, ${images} image${images === 1 ? "" : "s"})`);
  } catch (e) {
    if (e.name !== "AbortError") setStatus("il-status", e.message, true);
  }
}

// ---------------------------------------------------------------------------------------------- wiring
async function loadModels() {
  try {
    const resp = await fetch("/v1/models", { headers: headers(false) });
    if (!resp.ok) throw new Error(await errorMessage(resp));
    const body = await resp.json();
    $("model").replaceChildren(...body.data.map((m) => new Option(m.id, m.id)));
  } catch (e) {
    $("model").replaceChildren(new Option("(default)", ""));
  }
}

function init() {
  $("api-key").value = localStorage.getItem("u1serve-api-key") || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem("u1serve-api-key", $("api-key").value.trim());
    loadModels();
  });
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => {
      for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t === tab);
      for (const p of document.querySelectorAll(".panel")) p.classList.toggle("active", p.id === "tab-" + tab.dataset.tab);
    });
  }
  $("chat-send").addEventListener("click", sendChat);
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); sendChat(); }
  });
  $("chat-stop").addEventListener("click", () => stop("chat", "chat-status"));
  $("chat-clear").addEventListener("click", () => { history.length = 0; $("chat-log").innerHTML = ""; });
  $("img-generate").addEventListener("click", generateImage);
  $("img-stop").addEventListener("click", () => stop("image", "img-status"));
  $("il-send").addEventListener("click", sendInterleave);
  $("il-stop").addEventListener("click", () => stop("interleave", "il-status"));
  loadModels();
}

init();
