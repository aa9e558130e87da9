// The page's entry point: the chat playground and the engine view.
import { askForKey } from "/static/api.js";
import { startChat } from "/static/chat.js";
import { startEngineView } from "/static/engine.js";

const params = new URLSearchParams(window.location.search);
document.getElementById("set-key").addEventListener("click", () => askForKey("Set the API key."));
startChat();
startEngineView(Number(params.get("interval")) || 1000);
