// The browser client: microphone -> 16 kHz PCM16 -> /v1/realtime (OpenAI Realtime events), agent audio
// (22.05 kHz PCM16, one 80 ms packet per frame) played back-to-back behind a small jitter buffer, live
// agent text and user transcript. Everything the page knows is in `window.duplexState` (the browser
// test reads it). URL options: ?autostart=1 starts a call on load; &seconds=N ends input after N s.
// A connection lost mid-call (close 1006: no close frame) is resumed: the page reconnects with the call's
// resume token and the number of messages it received, for as long as the server keeps the call
// (docs/protocol.md, "Reconnecting a lost connection"); what the microphone hears meanwhile is dropped.
"use strict";

const IN_RATE = 16000, OUT_RATE = 22050, FRAME_IN = 1280;
const JITTER_S = 0.12;          // playback starts this far behind the first packet; re-armed on underrun

const state = window.duplexState = {
  status: "idle", callId: null, framesSent: 0, packetsReceived: 0, samplesReceived: 0, peakReceived: 0,
  agentText: "", userText: "", underruns: 0, errors: [], closed: false, closeCode: null, drained: null,
  micPeak: 0, messagesReceived: 0, resumes: 0,
};

const $ = (id) => document.getElementById(id);
let ws = null, micCtx = null, playCtx = null, micStream = null, micNode = null, playAt = 0, stopTimer = null;
let pending = new Float32Array(0);
let resume = null;                // {token, grace_s} from session.created; null: the call cannot be resumed
let reconnectUntil = 0;           // while reconnecting: when the server no longer holds the call

function setStatus(s) { state.status = s; $("status").textContent = s; }
function showError(code, message) {
  state.errors.push({ code, message });
  $("errors").textContent += `${code}: ${message}\n`;
}

function toBase64PCM16(f32) {
  const bytes = new Uint8Array(f32.length * 2);
  const view = new DataView(bytes.buffer);
  for (let i = 0; i < f32.length; i++) {
    const s = Math.max(-1, Math.min(1, f32[i]));
    view.setInt16(2 * i, Math.round(s * 32767), true);
  }
  let bin = "";
  for (let i = 0; i < bytes.length; i += 0x8000) bin += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(bin);
}

function fromBase64PCM16(b64) {
  const bin = atob(b64);
  const out = new Float32Array(bin.length >> 1);
  for (let i = 0; i < out.length; i++) {
    let v = bin.charCodeAt(2 * i) | (bin.charCodeAt(2 * i + 1) << 8);
    if (v >= 0x8000) v -= 0x10000;
    out[i] = v / 32768;
  }
  return out;
}

// Capture runs in an AudioWorklet at 16 kHz (the context resamples the device); the main thread cuts
// 1280-sample frames and sends one append per frame.
const WORKLET = `
class Tap extends AudioWorkletProcessor {
  process(inputs) {
    const ch = inputs[0] && inputs[0][0];
    if (ch) this.port.postMessage(ch.slice(0));
    return true;
  }
}
registerProcessor("tap", Tap);`;

function onMicSamples(chunk) {
  const joined = new Float32Array(pending.length + chunk.length);
  joined.set(pending); joined.set(chunk, pending.length);
  pending = joined;
  let peak = 0;
  for (let i = 0; i < chunk.length; i++) peak = Math.max(peak, Math.abs(chunk[i]));
  state.micPeak = Math.max(state.micPeak, peak);
  $("level").style.width = `${Math.min(100, peak * 300)}%`;
  if (reconnectUntil !== 0) pending = pending.slice(-FRAME_IN);   // a dropout drops what is said meanwhile
  while (pending.length >= FRAME_IN && ws && ws.readyState === WebSocket.OPEN && !state.inputEnded) {
    const frame = pending.subarray(0, FRAME_IN);
    ws.send(JSON.stringify({ type: "input_audio_buffer.append", audio: toBase64PCM16(frame) }));
    pending = pending.slice(FRAME_IN);
    state.framesSent++;
  }
}

function playPacket(pcm) {
  const buf = playCtx.createBuffer(1, pcm.length, OUT_RATE);
  buf.copyToChannel(pcm, 0);
  const src = playCtx.createBufferSource();
  src.buffer = buf;
  src.connect(playCtx.destination);
  const now = playCtx.currentTime;
  if (playAt < now) {                 // first packet, or the network fell behind: re-arm the buffer
    if (state.packetsReceived > 1) state.underruns++;
    playAt = now + JITTER_S;
  }
  src.start(playAt);
  playAt += pcm.length / OUT_RATE;    // packets are back to back: no gaps, no overlaps
}

function onEvent(ev) {
  switch (ev.type) {
    case "session.created":
      state.callId = ev.session.id;
      resume = ev.session.resume || null;
      fillVoices(ev.session.capabilities && ev.session.capabilities.voices, ev.session.audio.output.voice);
      break;
    case "response.output_audio.delta": {
      const pcm = fromBase64PCM16(ev.delta);
      state.packetsReceived++;
      state.samplesReceived += pcm.length;
      for (let i = 0; i < pcm.length; i++) state.peakReceived = Math.max(state.peakReceived, Math.abs(pcm[i]));
      playPacket(pcm);
      break;
    }
    case "response.output_audio_transcript.delta":
      state.agentText += ev.delta; $("agent").textContent = state.agentText; break;
    case "response.done":
      if (state.agentText && !state.agentText.endsWith("\n")) { state.agentText += "\n"; $("agent").textContent = state.agentText; }
      break;
    case "conversation.item.input_audio_transcription.delta":
      state.userText += ev.delta; $("user").textContent = state.userText; break;
    case "input_audio_buffer.drained":
      state.drained = ev.frames; break;
    case "error":
      showError(ev.error.code, ev.error.message); break;
  }
}

function fillVoices(voices, current) {
  const sel = $("voice");
  if (!voices || sel.options.length) return;
  for (const v of voices) { const o = document.createElement("option"); o.value = o.textContent = v; sel.appendChild(o); }
  sel.value = current;
}

async function start() {
  $("start").disabled = true; $("stop").disabled = false;
  Object.assign(state, { framesSent: 0, packetsReceived: 0, samplesReceived: 0, agentText: "", userText: "",
                         closed: false, inputEnded: false, endSent: false, drained: null, messagesReceived: 0,
                         resumes: 0 });
  $("agent").textContent = ""; $("user").textContent = ""; $("errors").textContent = "";
  setStatus("connecting");
  playCtx = new AudioContext({ sampleRate: OUT_RATE });
  micCtx = new AudioContext({ sampleRate: IN_RATE });
  await playCtx.resume(); await micCtx.resume();
  micStream = await navigator.mediaDevices.getUserMedia({
    audio: { channelCount: 1, echoCancellation: true, noiseSuppression: false, autoGainControl: false } });
  const url = URL.createObjectURL(new Blob([WORKLET], { type: "application/javascript" }));
  await micCtx.audioWorklet.addModule(url);
  micNode = new AudioWorkletNode(micCtx, "tap");
  micNode.port.onmessage = (e) => onMicSamples(e.data);
  micCtx.createMediaStreamSource(micStream).connect(micNode);
  // (not connected to the destination: we do not want to hear ourselves)

  resume = null; reconnectUntil = 0;
  connect("", () => {
    const session = { seed: parseInt($("seed").value || "0", 10), temperature: parseFloat($("temperature").value || "0") };
    const instructions = $("instructions").value.trim();
    if (instructions) session.instructions = instructions;
    // the page captures and plays at the model's own rates (16 kHz in, 22.05 kHz out): nothing is resampled
    session.audio = { input: { format: { type: "audio/pcm", rate: IN_RATE } },
                      output: { format: { type: "audio/pcm", rate: OUT_RATE } } };
    if ($("voice").value) session.audio.output.voice = $("voice").value;
    ws.send(JSON.stringify({ type: "session.update", session }));
    setStatus("in call");
    const seconds = parseFloat(new URLSearchParams(location.search).get("seconds") || "0");
    if (seconds > 0) stopTimer = setTimeout(stop, seconds * 1000);
  });
}

// One connection of the call: the first (query "") or one resuming it. `opened` runs when it opens.
function connect(query, opened) {
  // with serve.api_keys, open the page as /?api_key=<key>: a browser passes it as a subprotocol (it cannot set
  // headers on a WebSocket), as OpenAI's browser client does
  const key = new URLSearchParams(location.search).get("api_key");
  const protocols = key ? ["realtime", `openai-insecure-api-key.${key}`] : [];
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const sock = ws = new WebSocket(`${scheme}://${location.host}/v1/realtime${query}`, protocols);
  sock.onopen = () => { reconnectUntil = 0; opened(); };
  sock.onmessage = (m) => { state.messagesReceived++; onEvent(JSON.parse(m.data)); };
  sock.onclose = (e) => {
    if (e.code === 1006 && resume && (reconnectUntil === 0 || performance.now() < reconnectUntil)) {
      // lost, not closed: come back for the rest of the call while the server holds it
      if (reconnectUntil === 0) reconnectUntil = performance.now() + resume.grace_s * 1000;
      setStatus("reconnecting");
      setTimeout(() => connect(`?resume=${encodeURIComponent(resume.token)}&received=${state.messagesReceived}`,
                               () => { state.resumes++; setStatus("in call"); if (state.inputEnded) stop(); }),
                 250);
      return;
    }
    state.closed = true; state.closeCode = e.code; reconnectUntil = 0;
    setStatus(`call ended (${e.code}${e.reason ? " " + e.reason : ""})`);
    teardown();
  };
}

function stop() {
  // end of input: the server drains the frames it has, then closes the call (sent once a resumed
  // connection is open, if the call was reconnecting)
  state.inputEnded = true;
  if (ws && ws.readyState === WebSocket.OPEN && !state.endSent) {
    state.endSent = true;
    ws.send(JSON.stringify({ type: "input_audio_buffer.commit", final: true }));
    setStatus("finishing");
  }
  stopMic();
}

function stopMic() {
  if (stopTimer) { clearTimeout(stopTimer); stopTimer = null; }
  if (micStream) micStream.getTracks().forEach((t) => t.stop());
  if (micCtx) micCtx.close();
  micStream = micCtx = micNode = null;
}

function teardown() {
  stopMic();
  $("start").disabled = false; $("stop").disabled = true;
}

$("start").onclick = () => start().catch((e) => { showError("client", String(e)); setStatus("failed"); teardown(); });
$("stop").onclick = stop;
if (new URLSearchParams(location.search).get("autostart") === "1") $("start").click();
